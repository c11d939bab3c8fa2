"""The launch watchdog's thread and deadline logic (mpk/executors/watchdog.py) with fake launches:
no CUDA. A fake launch ends when told to, or when aborted (unless it ignores the abort)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from mpk.errors import WatchdogTimeout
from mpk.executors.watchdog import Watchdog

T = 0.3  # timeout_s of these tests
MARGIN = 0.5  # what the report may take beyond it (poll period, abort, report)


class FakeLaunch:
    def __init__(self, epoch: int, honours_abort: bool = True):
        self.epoch, self.honours_abort = epoch, honours_abort
        self.finished = threading.Event()
        self.aborted = False

    def done(self) -> bool:
        return self.finished.is_set()


class FakeProbe:
    def __init__(self):
        self.calls = []

    def snapshot(self, launch):
        self.calls.append(("snapshot", launch.epoch, launch.done()))
        return f"stuck in task 7 of launch {launch.epoch}"

    def abort(self, launch):
        self.calls.append(("abort", launch.epoch))
        launch.aborted = True
        if launch.honours_abort:
            launch.finished.set()

    def report(self, launch, snap, exited):
        return f"launch {launch.epoch}: {snap}; exited={exited}"


def _watch(wd, launch):
    wd.watch(launch.epoch, launch.done, launch)


def _raised_by(wd, deadline_s, **kw):
    """Call check() until it raises; the exception and the time it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            wd.check(**kw)
        except WatchdogTimeout as exc:
            return exc, time.monotonic() - t0
        time.sleep(0.005)
    return None, time.monotonic() - t0


def test_a_launch_that_never_completes_is_reported_at_the_next_call():
    probe = FakeProbe()
    wd = Watchdog(T, probe)
    hung = FakeLaunch(1)
    _watch(wd, hung)
    exc, took = _raised_by(wd, T + 3)
    assert exc is not None, "no report"
    assert T <= took + 0.02 and took < T + MARGIN
    assert "stuck in task 7 of launch 1" in str(exc) and "exited=True" in str(exc)
    # snapshot before the abort, while it still hung
    assert probe.calls[:2] == [("snapshot", 1, False), ("abort", 1)]
    wd.check()  # raised once, not again
    assert wd.pending() == []
    wd.close()


def test_a_launch_that_completes_files_no_report():
    probe = FakeProbe()
    wd = Watchdog(T, probe)
    ok = FakeLaunch(1)
    _watch(wd, ok)
    time.sleep(T / 3)
    ok.finished.set()
    time.sleep(T + 0.2)
    wd.check()
    assert probe.calls == [] and wd.pending() == []
    wd.close()


def test_two_launches_in_flight_each_get_their_own_limit_from_when_they_run():
    """Two hung launches queued at once: the second's clock starts when the first was stopped
    (it could not run before), so it is stopped about 2·T after the start, and the reports
    come out in order, one per call."""
    probe = FakeProbe()
    wd = Watchdog(T, probe)
    first, second = FakeLaunch(1), FakeLaunch(2)
    t0 = time.monotonic()
    _watch(wd, first)
    _watch(wd, second)
    exc1, _ = _raised_by(wd, T + 3)
    assert "launch 1:" in str(exc1)
    exc2, _ = _raised_by(wd, 2 * T + 3)
    took = time.monotonic() - t0
    assert "launch 2:" in str(exc2)
    assert 2 * T - 0.05 <= took < 2 * T + 2 * MARGIN
    wd.close()


def test_a_healthy_launch_queued_behind_a_hung_one_runs_to_completion():
    probe = FakeProbe()
    wd = Watchdog(T, probe)
    first, second = FakeLaunch(1), FakeLaunch(2)
    _watch(wd, first)
    _watch(wd, second)
    exc, _ = _raised_by(wd, T + 3)
    assert "launch 1:" in str(exc)
    time.sleep(T / 3)  # the second runs after the first was stopped, and ends within its limit
    second.finished.set()
    time.sleep(T)
    wd.check()
    assert [c for c in probe.calls if c[0] == "abort"] == [("abort", 1)]
    wd.close()


def test_wait_raises_its_launchs_report_and_check_upto_leaves_later_ones():
    probe = FakeProbe()
    wd = Watchdog(T, probe)
    first, second = FakeLaunch(1), FakeLaunch(2)
    _watch(wd, first)
    _watch(wd, second)
    t0 = time.monotonic()
    with pytest.raises(WatchdogTimeout, match="launch 1:"):
        wd.wait(1, first.done)
    assert time.monotonic() - t0 < T + MARGIN
    wd.check(upto=1)  # the second's report (when filed) is not the first's call's business
    with pytest.raises(WatchdogTimeout, match="launch 2:"):
        wd.wait(2, second.done)
    wd.wait(1, first.done)  # its report was raised: ended, nothing more to say
    wd.close()


def test_a_kernel_that_ignores_the_abort_is_reported_as_not_exited():
    probe = FakeProbe()
    wd = Watchdog(T, probe, exit_wait_s=0.2)
    stuck = FakeLaunch(1, honours_abort=False)
    _watch(wd, stuck)
    exc, took = _raised_by(wd, T + 3)
    assert "exited=False" in str(exc) and took < T + 0.2 + MARGIN
    wd.close()


def test_a_failing_probe_still_files_a_report():
    class Broken(FakeProbe):
        def snapshot(self, launch):
            raise OSError("status unreadable")

        def report(self, launch, snap, exited):
            assert isinstance(snap, OSError)
            raise ValueError("formatting failed")

    wd = Watchdog(T, Broken())
    _watch(wd, FakeLaunch(1))
    exc, _ = _raised_by(wd, T + 3)
    assert "launch 1 did not finish within 0.3 s" in str(exc) and "formatting failed" in str(exc)
    wd.close()


def test_the_thread_exits_with_its_owner():
    wd = Watchdog(T, FakeProbe())
    thread = wd.thread
    ok = FakeLaunch(1)
    _watch(wd, ok)
    ok.finished.set()
    del wd
    gc.collect()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_a_launch_in_flight_when_its_owner_goes_is_still_stopped_and_warned_about():
    wd = Watchdog(T, FakeProbe())
    thread = wd.thread
    hung = FakeLaunch(1)
    _watch(wd, hung)
    with pytest.warns(RuntimeWarning, match="launch 1: stuck in task 7"):
        wd.close()
        thread.join(timeout=T + 3)
    assert not thread.is_alive() and hung.aborted
