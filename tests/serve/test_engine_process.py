"""The engine in its own process: an engine that does not start ends ``mpk serve`` with its
reason; an engine process that dies fails the streams in flight, and the server then answers
503 and reports itself unhealthy; nothing waits for the dead process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import httpx
import pytest

from mpk.serve.engine import AsyncEngine, EngineStartError
from mpk.serve.metrics import Metrics
from mpk.testing.serve import served_llm

from .conftest import MODEL, free_port, serving

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 30  # what "at once" may take on a loaded machine


def test_a_bad_model_makes_mpk_serve_exit_non_zero_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mpk.cli", "serve", "--model", str(missing), "--port",
                           str(free_port()), "--log-level", "warning"], check=False, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the engine did not start" in done.stderr and str(missing) in done.stderr


def test_bad_options_raise_the_engines_reason(checkpoint):
    engine = AsyncEngine(partial(served_llm, checkpoint, max_num_seqs=0), Metrics(), max_queue=1)
    with pytest.raises(EngineStartError, match="max_num_seqs=0"):
        engine.start()
    assert not engine.alive


def _stream(url: str, started: threading.Event, events: list[dict]) -> None:
    """A long streamed completion: each event into ``events``, ``started`` at the first."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                started.set()


def test_a_killed_engine_process_ends_streams_with_an_error_then_503(checkpoint):
    with serving(checkpoint, step_delay=0.02) as server:
        started, events = threading.Event(), []
        t = threading.Thread(target=_stream, args=(server.url, started, events), daemon=True)
        t.start()
        assert started.wait(BOUND_S)
        os.kill(server.engine.pid, signal.SIGKILL)
        t.join(BOUND_S)
        assert not t.is_alive(), "the stream outlived its engine"
        why = "the engine process exited (exit code -9)"
        assert why in events[-1]["error"]["message"] and len(events) < 200
        health = httpx.get(f"{server.url}/health", timeout=BOUND_S)
        assert health.status_code == 503 and why in health.json()["status"]
        late = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                          timeout=BOUND_S)
        assert late.status_code == 503 and why in late.json()["error"]["message"]
        assert server.metrics()["mpk_requests_finished_total{error}"] == 1
