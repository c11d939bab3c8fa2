"""``AsyncEngine``: ``mpk.LLM``'s step loop on a thread of its own, fed from asyncio.

Handlers on the event loop hand requests and aborts to the engine thread through an inbox; the
thread applies them between steps, runs steps while any request is unfinished and sleeps on a
condition variable when none is, and posts each step's outputs to their requests' asyncio
queues (one ``call_soon_threadsafe`` per event loop and step). Only the engine thread touches the ``LLM``, so HTTP handling
never waits for a step and a step never waits for HTTP."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mpk.engine.llm import LLM
from mpk.engine.outputs import CompletionOutput, RequestOutput
from mpk.engine.sampling import SamplingParams
from mpk.errors import DistributedError, MpkError
from mpk.serve.metrics import Metrics

log = logging.getLogger("mpk.serve")


class EngineStoppedError(MpkError):
    """The engine thread stopped for good (a tensor-parallel rank failed): no request can run
    (HTTP 503)."""


class QueueFullError(MpkError):
    """The server holds as many requests as ``max_num_seqs + max_queue``; the client should
    retry later (HTTP 429)."""


@dataclass(eq=False)
class _Request:
    """A request as the engine thread tracks it (its id set when the thread admits it)."""

    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None
    first_token: float | None = None
    tokens: int = 0


class AsyncEngine:
    """``llm`` served to asyncio: ``generate`` per request, ``start``/``stop`` for the thread.
    ``max_queue``: requests that may wait for a sequence slot beyond the ``max_num_seqs`` that
    run; past that ``generate`` raises ``QueueFullError``."""

    def __init__(self, llm: LLM, metrics: Metrics, max_queue: int):
        self.llm, self.metrics = llm, metrics
        self.capacity = llm.scheduler.max_num_seqs + max_queue
        self._in_flight = 0  # requests between generate's start and end; event-loop thread only
        self._wake = threading.Condition()
        self._inbox: list[tuple[str, _Request]] = []
        self._stopping = False
        self.failure: str | None = None  # why the engine stopped for good (a rank failed)
        self._active: dict[int, _Request] = {}  # engine thread only
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # engine thread only: the step's outputs
        self._thread = threading.Thread(target=self._run, name="mpk-engine", daemon=True)
        metrics.pages_total.set(llm.blocks.num_pages)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread: unfinished requests fail ("the server is shutting down")."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Run one request: yields first its admission (an empty output; finished with
        ``error`` set if the engine refused it), then each step's new output until one is
        finished. Closing the generator early (the client left) aborts the request and frees
        its pages. Raises ``QueueFullError`` at the first ``anext`` when the server is full,
        ``EngineStoppedError`` when the engine stopped for good."""
        if self.failure is not None:
            raise EngineStoppedError(f"the engine stopped: {self.failure}")
        if self._in_flight >= self.capacity:
            raise QueueFullError(f"the server holds {self._in_flight} requests, its limit (--max-num-seqs + "
                                 "--max-queue); retry later")
        self._in_flight += 1
        req = _Request(ids, params, asyncio.get_running_loop())
        self._send("add", req)
        finished = False
        try:
            while not finished:
                out = await req.queue.get()
                finished = out.finished
                yield out
        finally:
            self._in_flight -= 1
            if not finished:
                self._send("abort", req)

    def _send(self, command: str, req: _Request) -> None:
        with self._wake:
            if self.failure is not None:  # the thread has gone: answer here (on the event loop)
                if command == "add":
                    req.queue.put_nowait(_failed(None, req, f"the engine stopped: {self.failure}"))
                return
            self._inbox.append((command, req))
            self._wake.notify()

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._stopping and not self.llm.has_unfinished():
                    self._wake.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            for command, req in commands:
                if command == "add":
                    self._add(req)
                else:
                    self._abort(req)
            if stopping:
                self._fail_all("the server is shutting down")
                self._flush()
                return
            if self.llm.has_unfinished():
                try:
                    outputs = self.llm.step()
                except DistributedError as e:  # a rank failed: the job is gone, so is this engine
                    log.error("engine stopped: %s", e)
                    self._stop_for_good(str(e))
                    self._flush()
                    return
                except Exception as e:  # the step's state is gone: fail its requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"the engine step failed: {type(e).__name__}: {e}")
                    outputs = []
                for out in outputs:
                    self._deliver(out)
            self._flush()
            self._publish()

    def _add(self, req: _Request) -> None:
        out = self.llm.add_request(req.ids, req.params)
        req.request_id = out.request_id
        if not out.finished:
            self._active[out.request_id] = req
            self.metrics.prompt_tokens.inc(len(req.ids))
        self._post(req, out)

    def _abort(self, req: _Request) -> None:
        if self._active.pop(req.request_id, None) is not None:
            self.llm.abort(req.request_id)
            self.metrics.finished.labels("abort").inc()

    def _deliver(self, out: RequestOutput) -> None:
        req = self._active.get(out.request_id)
        if req is None:
            return
        now, new = time.perf_counter(), len(out.outputs[0].token_ids)
        if new:
            if req.first_token is None:
                req.first_token = now
                self.metrics.ttft.observe(now - req.arrival)
            req.tokens += new
            self.metrics.generated_tokens.inc(new)
        if out.finished:
            del self._active[out.request_id]
            self.metrics.finished.labels(out.outputs[0].finish_reason).inc()
            self.metrics.e2e.observe(now - req.arrival)
            if req.tokens > 1:
                self.metrics.tpot.observe((now - req.first_token) / (req.tokens - 1))
        self._post(req, out)

    def _fail_all(self, message: str) -> None:
        """Fail every active request with ``message`` and drop whatever the engine holds."""
        for rid in list(self._active):
            self.llm.abort(rid)
            req = self._active.pop(rid)
            self.metrics.finished.labels("error").inc()
            self._post(req, _failed(rid, req, message))

    def _stop_for_good(self, why: str) -> None:
        """End the thread after a failure nothing recovers from: every request, active or
        waiting in the inbox, fails with ``why``; later ones are answered at once (503)."""
        with self._wake:
            self.failure = why
            waiting, self._inbox = self._inbox, []
        self._fail_all(f"the engine stopped: {why}")
        for command, req in waiting:
            if command == "add":
                self._post(req, _failed(None, req, f"the engine stopped: {why}"))

    def _post(self, req: _Request, out: RequestOutput) -> None:
        self._outbox.setdefault(req.loop, []).append((req.queue, out))

    def _flush(self) -> None:
        """Hand the step's outputs to their event loops: one wake-up of each loop per step (a
        wake-up per output would take the GIL from this thread once per stream and token)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody waits for these
                pass

    def _publish(self) -> None:
        s, b = self.llm.scheduler, self.llm.blocks
        self.metrics.waiting.set(len(s.waiting))
        self.metrics.running.set(len(s.running))
        self.metrics.pages_in_use.set(b.num_pages - b.num_free)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _failed(rid: int | None, req: _Request, message: str) -> RequestOutput:
    """A request's last output: failed with ``message``."""
    return RequestOutput(rid, None, req.ids, [CompletionOutput(finish_reason="error")], finished=True, error=message)
