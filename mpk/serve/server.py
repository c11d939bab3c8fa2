"""``mpk serve``: start the engine process (it loads the model; a model that does not load
ends ``mpk serve`` with the engine's reason), then uvicorn. SIGTERM stops taking requests, lets
those in flight finish (``DRAIN_SECONDS`` at most), stops the engine process and exits 0;
Ctrl-C drains the same way, then exits as interrupted (130)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import uvicorn

from mpk.serve.app import build_app
from mpk.serve.engine import AsyncEngine
from mpk.serve.metrics import Metrics

DRAIN_SECONDS = 30
# The thread that reads the engine's per-step messages must get the GIL soon from an event loop
# busy streaming to many clients: with CPython's default switch interval (5 ms) the messages
# would wait, and once the pipe is full the engine process waits to send its next step.
SWITCH_INTERVAL_S = 0.0005


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM it drained for is not raised again afterwards
    (uvicorn re-raises it so the process dies of it; a drained server has exited cleanly)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def served_name(model: str | None) -> str:
    """The model's name in the API: its file's stem or directory's name (default model: its
    GGUF's stem)."""
    if model is None:
        from mpk.llm.default_model import DEFAULT_GGUF

        return DEFAULT_GGUF.split(".")[0]
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def cmd_serve(ns: argparse.Namespace) -> int:
    from mpk.engine.llm import LLM

    sys.setswitchinterval(SWITCH_INTERVAL_S)

    # built in the engine process (under tensor parallelism it is rank 0 and starts the others)
    build = partial(LLM, ns.model, max_num_seqs=ns.max_num_seqs, max_model_len=ns.max_model_len,
                    page_size=ns.page_size, tensor_parallel_size=ns.tensor_parallel_size, executor=ns.executor,
                    max_num_batched_tokens=ns.max_num_batched_tokens, num_pages=ns.num_pages, seed=ns.seed,
                    enable_prefix_caching=not ns.no_prefix_caching, decode_iterations=ns.decode_iterations)
    name = ns.served_model_name or served_name(ns.model)
    engine = AsyncEngine(build, Metrics(), ns.max_queue)
    engine.start()  # EngineStartError: the CLI prints the engine's reason and exits 2
    try:
        app = build_app(engine, name, ns.api_key, aliases=(ns.model,) if ns.model else ())
        logging.getLogger("mpk.serve").info("serving %s on http://%s:%d", name, ns.host, ns.port)
        server = _Server(uvicorn.Config(app, host=ns.host, port=ns.port, timeout_graceful_shutdown=DRAIN_SECONDS,
                                        log_level=ns.log_level))
        server.run()
    finally:
        engine.stop()  # (the app stopped it already unless uvicorn failed first)
    return 0
