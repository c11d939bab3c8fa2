"""Fixtures of the server tests: a tiny random checkpoint (the engine tests' model), servers
over it started in this process (uvicorn on a free loopback port, in a thread; the engine in
its own process, as ``mpk serve`` runs it), and torch on one thread (tiny steps; several
threads on a shared machine only wait on each other)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import httpx
import pytest
import uvicorn

from mpk.serve.app import build_app
from mpk.serve.engine import AsyncEngine
from mpk.serve.metrics import Metrics
from mpk.testing.engine import one_thread, seeded_checkpoint
from mpk.testing.serve import served_llm

MODEL = "tiny"
MAX_LEN = 256


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return seeded_checkpoint(tmp_path_factory.mktemp("tiny") / MODEL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server: ``url``, ``engine`` (its ``AsyncEngine``), ``metrics()`` (name → value of the
    unlabelled samples and ``name{label}`` of labelled ones)."""

    def __init__(self, url: str, engine: AsyncEngine):
        self.url, self.engine = url, engine

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {s.name + ("{" + ",".join(s.labels.values()) + "}" if s.labels else ""): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_for(self, name: str, value: float, timeout: float = 20.0) -> None:
        """Poll /metrics until ``name`` equals ``value``."""
        deadline = time.monotonic() + timeout
        while (got := self.metrics().get(name)) != value:
            assert time.monotonic() < deadline, f"{name} stayed {got}; expected {value}"
            time.sleep(0.05)


@contextmanager
def serving(model: str | None, api_key: str | None = None, max_queue: int = 64, **options) -> Iterator[Server]:
    """A server over ``model`` (a path, None for the default model) on a free port until the
    block ends; ``options``: the ``LLM``'s and ``mpk.testing.serve.served_llm``'s (e.g.
    ``step_delay``, ``failing_steps``)."""
    engine = AsyncEngine(partial(served_llm, model, **{"max_num_seqs": 8, "max_model_len": MAX_LEN} | options),
                         Metrics(), max_queue)
    engine.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "default" if model is None else MODEL, api_key),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield Server(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()  # (the app's shutdown stopped it, unless the server did not start)


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[Server]:
    """A server over the tiny checkpoint: 8 sequences per step, 256 tokens each."""
    with serving(checkpoint) as s:
        yield s
