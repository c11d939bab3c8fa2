"""The server's Prometheus metrics, in a registry of their own (several servers may share a
process, e.g. in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; TPOT is per token, so its buckets are finer
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """What ``/metrics`` shows: HTTP requests by status, requests by finish reason, the engine's
    queue, running sequences and KV pages, token counters and latency histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mpk_http_requests", "HTTP requests to /v1 by status code", ["status"], registry=r)
        self.finished = Counter("mpk_requests_finished", "engine requests by finish reason (stop, length, abort, "
                                "error)", ["reason"], registry=r)
        self.waiting = Gauge("mpk_num_requests_waiting", "requests queued for a sequence slot", registry=r)
        self.running = Gauge("mpk_num_requests_running", "sequences in the running batch", registry=r)
        self.pages_in_use = Gauge("mpk_kv_pages_in_use", "KV-cache pages held by sequences", registry=r)
        self.pages_total = Gauge("mpk_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.prompt_tokens = Counter("mpk_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("mpk_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("mpk_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("mpk_time_per_output_token_seconds", "mean time per output token after the first",
                              registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("mpk_e2e_request_latency_seconds", "arrival to the last token", registry=r,
                             buckets=_LATENCY_BUCKETS)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
