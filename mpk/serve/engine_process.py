"""The engine process of ``mpk serve``: it builds ``mpk.LLM`` and runs its step loop; the HTTP
process (``mpk.serve.engine.AsyncEngine``) talks to it over two one-way pipes.

Why a process and not a thread: the step loop is host-bound Python between device waits, and
so is the HTTP side (parsing, SSE rendering, detokenised text for many streams). On one
interpreter they take turns holding the GIL, and a server on a thread lost 22–28% of the
engine's offline throughput at 16–64 streams. In its own process the loop holds a GIL of its
own, and the HTTP process costs it one pipe write per step.

Messages, HTTP process → engine: ``("add", key, prompt ids, SamplingParams)``,
``("abort", key)``, ``("stop",)``; a closed pipe (the HTTP process died) also stops it.
Engine → HTTP process: first ``("ready", EngineInfo)`` or ``("start_failed", message)``; then,
per loop iteration, ``("step", [Delta, ...], Gauges)`` (one pipe write however many requests
ran), and ``("stopped", why)`` when a failure nothing recovers from (a tensor-parallel rank
died) ended the engine. The engine process then closes the ``LLM`` (a tensor-parallel job's
workers, which it started, stop) and exits."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from mpk.engine.llm import LLM, Conversation, chat_prompt
from mpk.engine.outputs import RequestOutput
from mpk.errors import DistributedError

log = logging.getLogger("mpk.serve")


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP process needs of the engine it cannot reach directly: the tokenizer
    (prompts, chat templates, rendering) and the limits requests are checked against."""

    tokenizer: Any
    vocab: int
    max_model_len: int
    max_num_seqs: int
    num_pages: int

    def chat_prompt(self, conversation: Conversation) -> tuple[str, list[int]]:
        """(text, token ids) of the chat template's prompt for ``conversation``."""
        return chat_prompt(self.tokenizer, conversation)


class Delta(NamedTuple):
    """A request's output of one loop iteration: its admission (no tokens; ``finished`` with
    ``error`` if the engine refused it) or a step's new tokens, text and logprobs."""

    key: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    error: str | None
    finished: bool


class Gauges(NamedTuple):
    """The engine's queue and page pool after a loop iteration (``/metrics``)."""

    waiting: int
    running: int
    pages_in_use: int


def _delta(key: int, out: RequestOutput) -> Delta:
    c = out.outputs[0]
    return Delta(key, c.token_ids, c.text, c.logprobs, c.finish_reason, out.error, out.finished)


def _keep_running(signum: int, frame: Any) -> None:
    """The HTTP process decides when the engine stops (after it drained): a Ctrl-C to the
    terminal's process group, or a SIGTERM to every process of a container, must not end the
    engine under the requests being drained."""


def run_engine(build: Callable[[], LLM], commands: Connection, results: Connection) -> None:
    """The engine process's entry point: ``build()`` the ``LLM`` (picklable: e.g. a
    ``functools.partial`` of ``LLM`` and its options), report it ready or why it did not
    start, then serve ``commands`` until told to stop or the HTTP process is gone."""
    try:
        llm = build()
    except Exception as e:  # noqa: BLE001 (a bad model path, an OptionError, …: the HTTP process reports it)
        results.send(("start_failed", f"{type(e).__name__}: {e}"))
        return
    try:
        start = time.perf_counter()
        llm.compile(progress=False)  # every graph now: no request waits for a trace
        log.info("compiled the engine's graphs in %.1f s", time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001
        llm.close()
        results.send(("start_failed", f"{type(e).__name__}: {e}"))
        return
    # From here on the HTTP process decides when the engine stops (a signal before, while it
    # loads, ends it as it would any program). A Python handler, not SIG_IGN: ignored signals
    # stay ignored across exec, and processes this one starts must keep the default ones.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _keep_running)
    try:
        results.send(("ready", EngineInfo(llm.tokenizer, llm.vocab, llm.max_model_len, llm.scheduler.max_num_seqs,
                                          llm.blocks.num_pages)))
        _EngineLoop(llm, commands, results).run()
    except (BrokenPipeError, ConnectionResetError):  # the HTTP process is gone: nobody to answer
        pass
    finally:
        llm.close()


class _EngineLoop:
    """The step loop: apply the commands that arrived, step while a request is unfinished,
    send the iteration's outputs and gauges in one message; wait for a command when idle."""

    def __init__(self, llm: LLM, commands: Connection, results: Connection):
        self.llm, self.commands, self.results = llm, commands, results
        self.rids: dict[int, int] = {}  # request key → the LLM's request id, while it runs
        self.keys: dict[int, int] = {}  # and back
        self.outputs: list[Delta] = []

    def run(self) -> None:
        while True:
            if not self.llm.has_unfinished():
                self.commands.poll(None)  # idle: sleep until a command (or the pipe's end) arrives
            try:
                while self.commands.poll(0):
                    command = self.commands.recv()
                    if command[0] == "stop":
                        return
                    if command[0] == "add":
                        self._add(*command[1:])
                    else:
                        self._abort(command[1])
            except EOFError:  # the HTTP process is gone
                return
            if self.llm.has_unfinished():
                try:
                    outputs = self.llm.step()
                except DistributedError as e:  # a rank failed: the job is gone, so is this engine
                    log.error("engine stopped: %s", e)
                    self.results.send(("stopped", str(e)))
                    return
                except Exception as e:  # the step's state is gone: fail its requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"the engine step failed: {type(e).__name__}: {e}")
                    outputs = []
                for out in outputs:
                    self._deliver(out)
            self._send()

    def _add(self, key: int, ids: list[int], params: Any) -> None:
        out = self.llm.add_request(ids, params)
        if not out.finished:
            self.rids[key], self.keys[out.request_id] = out.request_id, key
        self.outputs.append(_delta(key, out))

    def _abort(self, key: int) -> None:
        rid = self.rids.pop(key, None)
        if rid is not None:  # (else it finished before the abort arrived)
            del self.keys[rid]
            self.llm.abort(rid)

    def _deliver(self, out: RequestOutput) -> None:
        key = self.keys.get(out.request_id)
        if key is None:
            return
        if out.finished:
            del self.keys[out.request_id], self.rids[key]
        self.outputs.append(_delta(key, out))

    def _fail_all(self, message: str) -> None:
        """Fail every running request with ``message`` and drop whatever the engine holds."""
        for key, rid in self.rids.items():
            self.llm.abort(rid)
            self.outputs.append(Delta(key, [], "", None, "error", message, True))
        self.rids.clear()
        self.keys.clear()

    def _send(self) -> None:
        s, b = self.llm.scheduler, self.llm.blocks
        outputs, self.outputs = self.outputs, []
        self.results.send(("step", outputs, Gauges(len(s.waiting), len(s.running), b.num_pages - b.num_free)))
