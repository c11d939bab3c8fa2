"""Fixtures of the server tests: a tiny random checkpoint (the engine tests' model), servers
over it started in this process (uvicorn on a free loopback port, in a thread), and torch on
one thread (tiny steps; several threads on a shared machine only wait on each other)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from mpk.engine.llm import LLM
from mpk.serve.app import build_app
from mpk.serve.engine import AsyncEngine
from mpk.serve.metrics import Metrics
from mpk.testing.engine import one_thread, seeded_checkpoint

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
    """A running server: ``url``, ``engine`` (its ``llm``), ``metrics()`` (name → value of the
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
def serving(model: str | LLM | None, step_delay: float = 0.0, api_key: str | None = None, max_queue: int = 64,
            **llm_options) -> Iterator[Server]:
    """A server over ``model`` (a path, None for the default model, or an ``LLM`` it then owns)
    on a free port until the block ends; ``step_delay``: seconds each engine step is slowed by
    (so that a request is surely still running)."""
    options = {"max_num_seqs": 8, "max_model_len": MAX_LEN} | llm_options
    llm = model if isinstance(model, LLM) else LLM(model, **options)
    if step_delay:
        step = llm.step

        def slow_step():
            time.sleep(step_delay)
            return step()
        llm.step = slow_step
    engine = AsyncEngine(llm, Metrics(), max_queue)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "default" if model is None else MODEL, api_key),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[Server]:
    """A server over the tiny checkpoint: 8 sequences per step, 256 tokens each."""
    with serving(checkpoint) as s:
        yield s
