"""The launch watchdog: a daemon thread per executor that notices a launch outliving its time
limit, stops it and keeps its report until the executor's next call raises it.

The logic here touches no CUDA: an executor hands it a ``Probe`` (read the status of a stuck
launch, set the abort flag, write the report) and, per launch, a ``done()`` callable, so the
thread and deadline logic is tested on the CPU with fakes (tests/unit/test_watchdog.py).

Launches run in the order they were issued (an executor's launches are ordered on its
streams), so only the oldest in flight is running: its clock starts when it was issued or
when its predecessor was seen to end, whichever is later, and a launch queued behind a hung
one is not charged for the wait. The thread polls the oldest launch every ``poll_s``; past
its limit it snapshots the status (while the launch still hangs), sets the abort flag, waits
up to ``exit_wait_s`` for the kernel to leave, and files the report. ``check`` raises the
oldest filed report (``WatchdogTimeout``); a report is never dropped: one still filed when
the watchdog closes is issued as a warning.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from mpk.errors import WatchdogTimeout


class Probe(Protocol):
    """What the watchdog does to a launch, given the object ``watch`` was handed with it."""

    def snapshot(self, launch: Any) -> Any: ...  # read the state of a launch that hangs (before the abort)

    def abort(self, launch: Any) -> None: ...  # ask it (and anything before it) to stop

    def report(self, launch: Any, snapshot: Any, exited: bool) -> str: ...


@dataclass
class _Launch:
    epoch: int
    done: Callable[[], bool]
    info: Any
    issued: float
    start: float | None = None  # when its clock started (it became the oldest in flight)


@dataclass
class _State:
    """Shared by the watchdog object and its thread; the thread holds no reference to the
    executor, so dropping the executor closes the watchdog."""

    timeout_s: float
    probe: Probe
    poll_s: float
    exit_wait_s: float
    clock: Callable[[], float]
    cond: threading.Condition = field(default_factory=threading.Condition)
    inflight: deque = field(default_factory=deque)
    reports: deque = field(default_factory=deque)  # (epoch, text), oldest first
    firing: int = 0  # the epoch being stopped now (0: none)
    closed: bool = False


def _run(state: _State) -> None:
    while True:
        with state.cond:
            while not state.inflight and not state.closed:
                state.cond.wait()
            if not state.inflight:  # closed and nothing left to watch
                break
        _poll(state)
        with state.cond:
            if state.inflight:
                state.cond.wait(state.poll_s)
    with state.cond:  # nobody is left to raise them
        left = list(state.reports)
        state.reports.clear()
    for _, text in left:
        warnings.warn(f"a launch of an executor no longer in use hung:\n{text}", RuntimeWarning, stacklevel=1)


def _poll(state: _State) -> None:
    """Drop the launches seen done; stop the oldest if it outlived its limit."""
    while True:
        with state.cond:
            if not state.inflight:
                return
            head = state.inflight[0]
        now = state.clock()
        if head.start is None:
            head.start = max(head.issued, now)
        if head.done():
            with state.cond:
                state.inflight.popleft()
                if state.inflight and state.inflight[0].start is None:
                    state.inflight[0].start = max(state.inflight[0].issued, state.clock())
            continue
        if now - head.start < state.timeout_s:
            return
        _fire(state, head)


def _fire(state: _State, head: _Launch) -> None:
    with state.cond:
        state.firing = head.epoch
    text = f"mpk watchdog: launch {head.epoch} did not finish within {state.timeout_s:.1f} s"
    try:
        try:
            snap = state.probe.snapshot(head.info)
        except Exception as exc:  # the report still goes out, without the state it could not read
            snap = exc
        state.probe.abort(head.info)
        deadline = state.clock() + state.exit_wait_s
        exited = head.done()
        while not exited and state.clock() < deadline:
            time.sleep(min(0.001, state.poll_s))
            exited = head.done()
        text = state.probe.report(head.info, snap, exited)
    except Exception as exc:  # never lose the fact of the hang
        text += f" (the watchdog failed to stop it or to write its report: {exc!r})"
    finally:
        with state.cond:
            if state.inflight and state.inflight[0] is head:
                state.inflight.popleft()
                if state.inflight:  # the next launch's clock starts now that this one left
                    state.inflight[0].start = max(state.inflight[0].issued, state.clock())
            state.reports.append((head.epoch, text))
            state.firing = 0
            state.cond.notify_all()


class Watchdog:
    """One executor's watchdog. ``watch(epoch, done, info)`` after each launch; ``check()`` at
    each call that touches the executor; ``close()`` (or dropping it) ends the thread once the
    launches in flight have ended or been stopped."""

    def __init__(self, timeout_s: float, probe: Probe, poll_s: float | None = None, exit_wait_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        poll = min(0.05, timeout_s / 20) if poll_s is None else poll_s
        self._state = _State(timeout_s, probe, poll, exit_wait_s, clock)
        self.thread = threading.Thread(target=_run, args=(self._state,), name="mpk-watchdog", daemon=True)
        self.thread.start()
        self._finalizer = weakref.finalize(self, _close, self._state)

    @property
    def timeout_s(self) -> float:
        return self._state.timeout_s

    def watch(self, epoch: int, done: Callable[[], bool], info: Any = None) -> None:
        st = self._state
        with st.cond:
            if st.closed:
                raise RuntimeError("the watchdog is closed")
            st.inflight.append(_Launch(epoch, done, info, st.clock()))
            if len(st.inflight) == 1:  # the thread sleeps until there is a launch; else it polls anyway
                st.cond.notify_all()

    def pending(self) -> list[int]:
        """The epochs whose reports are filed and not yet raised."""
        with self._state.cond:
            return [e for e, _ in self._state.reports]

    def check(self, upto: int | None = None) -> None:
        """Raise the oldest filed report (of a launch numbered ``upto`` or earlier, if given) as
        ``WatchdogTimeout``; first waits for a report being written for such a launch."""
        st = self._state
        with st.cond:
            while st.firing and (upto is None or st.firing <= upto):
                st.cond.wait()
            if st.reports and (upto is None or st.reports[0][0] <= upto):
                _, text = st.reports.popleft()
                raise WatchdogTimeout(text)

    def wait(self, epoch: int, done: Callable[[], bool], sleep_s: float = 0.0005) -> None:
        """Block until launch ``epoch`` ends; raise its report (or an earlier one) if the
        watchdog stopped it. Short launches are polled, long ones slept on."""
        start = time.monotonic()
        while not done():
            self.check(upto=epoch)
            if time.monotonic() - start > 0.002:
                time.sleep(sleep_s)
        self.check(upto=epoch)

    def close(self) -> None:
        self._finalizer()

    def closed(self) -> bool:
        return not self.thread.is_alive()


def _close(state: _State) -> None:
    with state.cond:
        state.closed = True
        state.cond.notify_all()
