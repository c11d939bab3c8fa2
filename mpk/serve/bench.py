"""``mpk bench serve``: a request sweep against a running ``mpk serve`` over HTTP. Per sweep
point (a concurrency, or a Poisson arrival rate) ``--num-prompts`` streamed completions of
random ``--input-len``-token prompts and ``--output-len`` tokens each (EOS ignored); prints a JSON
line per point (TTFT, TPOT and end-to-end latency p50/p99, throughput) and a table last."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from mpk.engine.stats import percentile
from mpk.errors import MpkError

# prompt token ids are drawn below this: every vocabulary mpk loads has them (byte-level BPEs
# start with the 256 bytes)
PROMPT_ID_LIMIT = 256
DEFAULT_CONCURRENCY = (1, 4, 16, 64)


@dataclass
class Sample:
    """One request's timings (seconds) and tokens; ``error`` if it failed."""

    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.ttft is not None and self.tokens > 1 else None


async def _request(client: httpx.AsyncClient, model: str, ids: list[int], output_len: int) -> Sample:
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sample, start = Sample(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            sample.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return sample
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                sample.error = doc["error"]["message"]
            elif doc["choices"] and sample.ttft is None:
                sample.ttft = time.perf_counter() - start
            if doc.get("usage"):
                sample.tokens = doc["usage"]["completion_tokens"]
    sample.e2e = time.perf_counter() - start
    return sample


async def _point(client: httpx.AsyncClient, model: str, prompts: list[list[int]], output_len: int,
                 concurrency: int | None, rate: float | None, rng: random.Random) -> tuple[list[Sample], float]:
    """Every prompt's sample, at ``concurrency`` requests in flight or arriving at ``rate``/s;
    and the seconds the point took."""
    start = time.perf_counter()
    if concurrency is not None:
        gate = asyncio.Semaphore(concurrency)

        async def gated(ids: list[int]) -> Sample:
            async with gate:
                return await _request(client, model, ids, output_len)
        samples = await asyncio.gather(*(gated(p) for p in prompts))
    else:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_request(client, model, p, output_len)))
            await asyncio.sleep(rng.expovariate(rate))
        samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - start


def _summary(samples: list[Sample], seconds: float) -> dict[str, float | int]:
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    doc: dict[str, float | int] = {"completed": len(ok), "failed": len(samples) - len(ok), "seconds": seconds,
                                   "requests_per_s": len(ok) / seconds, "output_tokens_per_s": tokens / seconds}
    for name, values in (("ttft", [s.ttft for s in ok if s.ttft is not None]),
                         ("tpot", [s.tpot for s in ok if s.tpot is not None]), ("e2e", [s.e2e for s in ok])):
        for q in (50, 99):
            doc[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q)
    return doc


def _table(rows: list[dict]) -> str:
    cols = ("load", "completed", "failed", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
            "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    cells = [[str(r[c]) if isinstance(r[c], (int, str)) else f"{r[c]:.1f}" for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [list(cols), *cells])


async def sweep(ns: argparse.Namespace) -> list[dict]:
    """The sweep ``ns`` asks for against a running server: one row per point (also printed as a
    JSON line)."""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    rng = random.Random(ns.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=ns.url, headers=headers, timeout=None, limits=limits) as client:
        try:
            r = await client.get("/v1/models")
        except httpx.HTTPError as e:
            raise MpkError(f"no server answers at {ns.url} ({e}); start one with `mpk serve`") from None
        if r.status_code != 200:
            raise MpkError(f"GET {ns.url}/v1/models answered {r.status_code}: {r.text[:200]}")
        model = r.json()["data"][0]["id"]
        await _request(client, model, [1] * ns.input_len, 2)  # warm up (the first step compiles)
        points = [("rate", x) for x in ns.rates] if ns.rates else \
            [("concurrency", c) for c in ns.concurrency or DEFAULT_CONCURRENCY]
        rows = []
        for kind, x in points:
            prompts = [[rng.randrange(PROMPT_ID_LIMIT) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
            samples, seconds = await _point(client, model, prompts, ns.output_len,
                                            x if kind == "concurrency" else None, x if kind == "rate" else None, rng)
            doc = {"bench": "serve", kind: x, "num_prompts": ns.num_prompts, "input_len": ns.input_len,
                   "output_len": ns.output_len, **_summary(samples, seconds)}
            print(json.dumps(doc), flush=True)
            rows.append(doc | {"load": f"{kind}={x:g}"})
        return rows


def bench_serve(ns: argparse.Namespace) -> int:
    """Run the sweep ``ns`` asks for; 1 if any request failed."""
    if ns.rates and not all(r > 0 for r in ns.rates):
        raise MpkError(f"--rates {ns.rates}; expected rates > 0 (requests per second)")
    rows = asyncio.run(sweep(ns))
    print(_table(rows))
    return 1 if any(r["failed"] for r in rows) else 0
