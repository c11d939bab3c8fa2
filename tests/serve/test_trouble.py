"""What goes wrong, answered as OpenAI does: bad input → 400 naming the field, a wrong or
missing API key → 401, a full queue → 429, a client leaving mid-stream → its request aborted
and its pages freed; and /metrics parses."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MAX_LEN, MODEL, serving

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"model": "gpt-4"}, "model"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"temperature": -0.5}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"n": 2}, "n"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1, 10 ** 6]}, "prompt"),
    ("completions", {"prompt": "x" * MAX_LEN}, "prompt"),
    ("completions", {"prompt": "x" * 100, "max_tokens": MAX_LEN}, "max_tokens"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_LEN}]}, "messages"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}/v1/{path}", json=(CHAT if path.startswith("chat") else COMPLETION) | body,
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"]


def test_malformed_json_is_a_400(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny", "prompt": ', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json=["not", "an", "object"], timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_the_api_key_is_required(checkpoint):
    with serving(checkpoint, api_key="sesame") as server:
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        missing = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30)  # no Authorization
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(**COMPLETION).usage.completion_tokens >= 1
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
        assert server.metrics()["mpk_http_requests_total{401}"] == 2


def _stream_until_first_chunk(url: str, body: dict, started: threading.Event, release: threading.Event) -> None:
    """Stream a completion: set ``started`` at its first chunk, then hang up at ``release``."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
                release.wait(60)
                return


def test_a_full_queue_answers_429(checkpoint):
    long = COMPLETION | {"max_tokens": 200, "ignore_eos": True}
    with serving(checkpoint, step_delay=0.02, max_num_seqs=1, max_queue=1) as server:
        release = threading.Event()
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream_until_first_chunk, args=(server.url, long, s, release))
                   for s in started]
        threads[0].start()
        assert started[0].wait(30)  # running: the one sequence slot taken
        threads[1].start()
        server.wait_for("mpk_num_requests_waiting", 1)  # queued: the queue of one is full
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(**COMPLETION)
        assert caught.value.status_code == 429 and "--max-queue" in caught.value.message
        release.set()
        for t in threads:
            t.join(60)
        server.wait_for("mpk_kv_pages_in_use", 0)
        assert client.completions.create(**COMPLETION).usage.completion_tokens >= 1  # room again


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_pages(checkpoint):
    with serving(checkpoint, step_delay=0.02) as server:
        idle = server.metrics()["mpk_kv_pages_in_use"]
        started, release = threading.Event(), threading.Event()
        body = COMPLETION | {"max_tokens": 200, "ignore_eos": True, "prompt": "y" * 40}
        t = threading.Thread(target=_stream_until_first_chunk, args=(server.url, body, started, release))
        t.start()
        assert started.wait(30)
        assert server.metrics()["mpk_kv_pages_in_use"] > idle  # the running request holds pages
        release.set()  # hang up
        t.join(30)
        server.wait_for("mpk_kv_pages_in_use", idle)
        m = server.metrics()
        assert m["mpk_requests_finished_total{abort}"] == 1 and m["mpk_num_requests_running"] == 0
        assert m["mpk_generation_tokens_total"] < 200  # stopped, not run to its end


def test_metrics_parse_and_count(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    before = server.metrics()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("mpk_http_requests", "mpk_num_requests_waiting", "mpk_num_requests_running", "mpk_kv_pages_in_use",
                 "mpk_time_to_first_token_seconds", "mpk_time_per_output_token_seconds",
                 "mpk_e2e_request_latency_seconds", "mpk_generation_tokens"):
        assert name in families, name
    after = server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)
    assert grew("mpk_http_requests_total{200}") == 3 and grew("mpk_generation_tokens_total") == 15
    assert grew("mpk_time_to_first_token_seconds_count") == 3 and grew("mpk_e2e_request_latency_seconds_count") == 3
    assert grew("mpk_time_per_output_token_seconds_count") == 3
    assert after["mpk_kv_pages_in_use"] == 0
    assert json.loads(httpx.get(f"{server.url}/health").text) == {"status": "ok"}
