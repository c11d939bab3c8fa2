"""``AsyncEngine``: ``mpk.LLM``'s step loop in a process of its own, fed from asyncio.

The loop runs in a separate process (``mpk.serve.engine_process``) because on a thread it
shared the GIL with the event loop, and the two slowed each other (the server lost 22–28% of
the engine's offline throughput at 16–64 streams). The process is started with the "spawn"
method: a forked child would inherit whatever CUDA or thread state this process holds.

Here, in the HTTP process: handlers put their requests and aborts on a queue that a sender
thread writes to the engine's pipe (a full pipe never blocks the event loop), and a reader
thread takes each of the engine's per-step messages, sets the gauges and hands the step's
outputs to the event loop in one ``call_soon_threadsafe``; there they go to the requests'
asyncio queues, and the latency metrics are taken. If the engine process exits or reports a
failure it does not recover from, every request in flight fails and later ones get
``EngineStoppedError`` (HTTP 503)."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mpk.engine.llm import LLM
from mpk.engine.outputs import CompletionOutput, RequestOutput
from mpk.engine.sampling import SamplingParams
from mpk.errors import MpkError
from mpk.serve.engine_process import Delta, EngineInfo, run_engine
from mpk.serve.metrics import Metrics

log = logging.getLogger("mpk.serve")

STOP_SECONDS = 30.0  # how long ``stop`` waits for the engine process to close the LLM before killing it


class EngineStartError(MpkError):
    """The engine process could not build the ``LLM`` (e.g. a bad model path) or exited before
    it was ready; the message says why."""


class EngineStoppedError(MpkError):
    """The engine stopped for good (a tensor-parallel rank failed, or the engine process
    exited): no request can run (HTTP 503)."""


class QueueFullError(MpkError):
    """The server holds as many requests as ``max_num_seqs + max_queue``; the client should
    retry later (HTTP 429)."""


@dataclass(eq=False)
class _Request:
    """A request as this process tracks it between ``generate``'s start and its last output."""

    ids: list[int]
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    admitted: bool = False
    first_token: float | None = None
    tokens: int = 0


class AsyncEngine:
    """The ``LLM`` that ``build()`` makes in the engine process, served to asyncio: ``start``
    (waits until the engine is ready), ``generate`` per request, ``stop``. ``build`` must be
    picklable (a ``functools.partial`` of ``LLM`` and its options, or a module-level function).
    ``max_queue``: requests that may wait for a sequence slot beyond the ``max_num_seqs`` that
    run; past that ``generate`` raises ``QueueFullError``. The engine serves one event loop:
    the one of the first ``generate``."""

    def __init__(self, build: Callable[[], LLM], metrics: Metrics, max_queue: int):
        self.metrics, self.max_queue = metrics, max_queue
        self.info: EngineInfo | None = None  # set by ``start``
        self.failure: str | None = None  # why the engine stopped for good
        self._build = build
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._keys = itertools.count()
        self._active: dict[int, _Request] = {}  # by key; event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._stopping = False

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``start``)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> EngineInfo:
        """Start the engine process and wait until it has built the ``LLM`` (loading and
        compiling the model may take minutes). Raises ``EngineStartError`` with the engine's
        reason if it could not, or if the process exited first."""
        ctx = multiprocessing.get_context("spawn")
        commands_r, self._commands = ctx.Pipe(duplex=False)
        self._results, results_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine, args=(self._build, commands_r, results_w), name="mpk-engine")
        self._proc.start()
        # The engine ignores SIGINT and SIGTERM (this process drains first, then stops it), so a
        # process of ours that exits without ``stop`` kills it, before multiprocessing's own exit
        # handler (registered earlier, so run later) would wait for it forever.
        atexit.register(_kill_if_alive, self._proc)
        # this process's copies of the engine's ends closed: the engine's exit reads as EOF here
        commands_r.close()
        results_w.close()
        try:
            message = self._results.recv()
        except EOFError:
            message = ("start_failed", None)
        except BaseException:  # e.g. Ctrl-C while the model loads
            _kill_if_alive(self._proc)
            self._close_pipes()
            raise
        if message[0] == "start_failed":
            self._proc.join(STOP_SECONDS)
            _kill_if_alive(self._proc)
            self._close_pipes()
            if message[1] is None:
                raise EngineStartError(f"the engine process exited (exit code {self._proc.exitcode}) before the "
                                       "model was ready; its output above says why")
            raise EngineStartError(f"the engine did not start: {message[1]}")
        self.info = message[1]
        self.metrics.pages_total.set(self.info.num_pages)
        self._reader = threading.Thread(target=self._read, name="mpk-engine-reader", daemon=True)
        self._sender = threading.Thread(target=self._write, name="mpk-engine-sender", daemon=True)
        self._reader.start()
        self._sender.start()
        return self.info

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the engine process (a tensor-parallel job's workers stop with it): requests
        still unfinished fail ("the server is shutting down"). Kills it after ``timeout``."""
        if self.info is None or self._stopping:
            return
        self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.put(None)  # the sender's end
        self._reader.join(timeout)  # it ends once the engine process has exited (and reaps it)
        if self._proc.is_alive():
            log.error("the engine process did not stop within %.0f s; killing it", timeout)
            _kill_if_alive(self._proc)
        self._sender.join(timeout)
        self._close_pipes()

    @property
    def alive(self) -> bool:
        """Whether requests can run: started, not stopped, not failed."""
        return self.info is not None and self._reader.is_alive() and self.failure is None and not self._stopping

    @property
    def capacity(self) -> int:
        assert self.info is not None, "start() the engine first"
        return self.info.max_num_seqs + self.max_queue

    async def generate(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Run one request: yields first its admission (an empty output; finished with
        ``error`` set if the engine refused it), then each step's new output until one is
        finished. Closing the generator early (the client left) aborts the request and frees
        its pages. Raises ``QueueFullError`` at the first ``anext`` when the server is full,
        ``EngineStoppedError`` when the engine stopped for good."""
        self._loop = self._loop or asyncio.get_running_loop()
        if self.failure is not None or self._stopping:
            raise EngineStoppedError(f"the engine stopped: {self.failure or 'the server is shutting down'}")
        if len(self._active) >= self.capacity:
            raise QueueFullError(f"the server holds {len(self._active)} requests, its limit (--max-num-seqs + "
                                 "--max-queue); retry later")
        key, req = next(self._keys), _Request(ids)
        self._active[key] = req
        self._outbox.put(("add", key, ids, params))
        if self.failure is not None or self._stopping:  # it stopped meanwhile: its _fail_all may have run already
            self._fail_all(f"the engine stopped: {self.failure or 'the server is shutting down'}")
        finished = False
        try:
            while not finished:
                out = await req.queue.get()
                finished = out.finished
                yield out
        finally:
            if self._active.pop(key, None) is not None:  # the client left before the end: abort it
                self.metrics.finished.labels("abort").inc()
                self._outbox.put(("abort", key))

    # --- the sender and reader threads ------------------------------------------------------

    def _write(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._commands.send(command)
            except OSError:  # the engine process is gone; the reader reports it
                return
            except Exception as e:  # noqa: BLE001 (a command that cannot be sent: nothing later would be)
                self._stop_for_good(f"sending to the engine process failed: {type(e).__name__}: {e}")
                return

    def _read(self) -> None:
        """Until the engine's pipe ends: gauges set here, outputs handed to the event loop."""
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                break
            if message[0] == "step":
                _, outputs, gauges = message
                self.metrics.waiting.set(gauges.waiting)
                self.metrics.running.set(gauges.running)
                self.metrics.pages_in_use.set(gauges.pages_in_use)
                if outputs:
                    self._call_soon(self._dispatch, outputs)
            else:  # ("stopped", why): the engine failed for good and is exiting
                self._stop_for_good(message[1])
        self._proc.join(5)  # the exit code, for the report
        if self.failure is None and not self._stopping:
            self._stop_for_good(f"the engine process exited (exit code {self._proc.exitcode})")
        elif self._stopping:
            self._call_soon(self._fail_all, "the server is shutting down")

    def _stop_for_good(self, why: str) -> None:
        log.error("engine stopped: %s", why)
        self.failure = why
        self._outbox.put(None)  # nothing more to send
        self._call_soon(self._fail_all, f"the engine stopped: {why}")

    def _call_soon(self, fn: Callable, arg: object) -> None:
        if self._loop is None:  # no request ever ran: nobody to tell
            return
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: nobody waits for these
            pass

    # --- on the event loop --------------------------------------------------------------------

    def _dispatch(self, deltas: list[Delta]) -> None:
        """One engine step's outputs to their requests' queues (one wake-up of the event loop
        per step, not per stream and token), with the latency and token metrics."""
        now = time.perf_counter()
        for d in deltas:
            req = self._active.get(d.key)
            if req is None:  # aborted meanwhile
                continue
            if not req.admitted:
                req.admitted = True
                if d.finished:  # refused at admission (e.g. an empty prompt): not counted as run
                    del self._active[d.key]
                else:
                    self.metrics.prompt_tokens.inc(len(req.ids))
            else:
                self._measure(req, d, now)
                if d.finished:
                    del self._active[d.key]
            req.queue.put_nowait(RequestOutput(d.key, None, req.ids, [CompletionOutput(
                text=d.text, token_ids=d.token_ids, finish_reason=d.finish_reason, logprobs=d.logprobs)],
                finished=d.finished, error=d.error))

    def _measure(self, req: _Request, d: Delta, now: float) -> None:
        if d.token_ids:
            if req.first_token is None:
                req.first_token = now
                self.metrics.ttft.observe(now - req.arrival)
            req.tokens += len(d.token_ids)
            self.metrics.generated_tokens.inc(len(d.token_ids))
        if d.finished:
            self.metrics.finished.labels(d.finish_reason).inc()
            self.metrics.e2e.observe(now - req.arrival)
            if req.tokens > 1:
                self.metrics.tpot.observe((now - req.first_token) / (req.tokens - 1))

    def _fail_all(self, message: str) -> None:
        """Fail every request in flight with ``message`` (the engine is gone)."""
        for key, req in list(self._active.items()):
            del self._active[key]
            self.metrics.finished.labels("error").inc()
            req.queue.put_nowait(RequestOutput(key, None, req.ids, [CompletionOutput(finish_reason="error")],
                                               finished=True, error=message))

    def _close_pipes(self) -> None:
        self._commands.close()
        self._results.close()


def _kill_if_alive(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join()
