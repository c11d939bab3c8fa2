"""``Monitor``: each rank of a tensor-parallel job watches the others and stops its own work
when one dies, instead of waiting forever for a peer's signal or message.

Every rank beats (a counter in the job's store, ``hb/<rank>``) every ``interval_s``; a rank
whose counter has not moved for ``timeout_s`` (the watchdog limit) is reported dead or hung.
The driver (rank 0) also holds the processes it started and sees one exit at once. Counters
rather than timestamps: a rank's clock is only compared with itself. The store lives on rank 0
(or torchrun's agent), so a worker whose store calls fail has lost rank 0. A rank that leaves
cleanly sets ``bye/<rank>`` first and is not reported. The first monitor to see a failure
writes it to ``failed``, and every other rank stops on it at its next beat.

On the first failure the monitor files its report (``failure``), ends the failed rank if it
started it (a hung process holds its sockets open: collectives with it would wait), runs the
abort callbacks
(the GPU executors' abort flags: a kernel waiting for a dead peer's signal returns) and, on a
worker, ends the process after ``exit_grace_s`` if its main thread has not ended it: a worker
has nothing to report to but its log and must not outlive the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

from mpk.errors import RankFailedError


class Monitor:
    """Watches ranks ``0…world-1`` other than ``rank`` through ``store`` (a
    ``torch.distributed.Store``); ``procs``: the processes this rank started, by rank.
    ``start()`` begins beating and watching; ``check()`` raises the filed failure;
    ``close()`` says goodbye and stops the thread. ``exit_grace_s``: how long a failed worker's
    main thread has to end the process itself (None: it is never ended for it)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, procs: Mapping[int, subprocess.Popen] = {},
                 interval_s: float | None = None, exit_grace_s: float | None = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.procs = dict(procs)
        self.interval_s = min(1.0, timeout_s / 10) if interval_s is None else interval_s
        self.exit_grace_s, self.clock = exit_grace_s, clock
        self.failure: RankFailedError | None = None
        self._aborts: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mpk-monitor-{rank}", daemon=True)

    def on_failure(self, abort: Callable[[], None]) -> None:
        """Call ``abort`` (once) when a rank fails, or now if one already has."""
        with self._lock:
            self._aborts.append(abort)
            failed = self.failure is not None
        if failed:
            abort()

    def start(self) -> "Monitor":
        self.store.add(f"hb/{self.rank}", 1)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise the failure filed so far (``RankFailedError`` naming the rank), if any."""
        if self.failure is not None:
            raise self.failure

    def wait_failure(self, timeout_s: float) -> RankFailedError | None:
        """The failure, waiting up to ``timeout_s`` for one (an error on a peer's socket is
        often seen a beat before the monitor names the peer)."""
        deadline = self.clock() + timeout_s
        while self.failure is None and self.clock() < deadline and self._thread.is_alive():
            time.sleep(min(0.01, self.interval_s))
        return self.failure

    def close(self) -> None:
        """Leave cleanly: the others stop watching this rank; the thread ends."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(f"bye/{self.rank}", "1")
        except Exception:  # the store's host is gone already: nobody is left to tell
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5 * self.interval_s + 1)

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        seen = {r: (-1, self.clock()) for r in others}  # rank → (its counter, when it last moved)
        while not self._stop.wait(self.interval_s):
            failed = self._look(others, seen)
            if failed is not None:
                self._fail(*failed)
                return

    def _look(self, others: list[int], seen: dict[int, tuple[int, float]]) -> tuple[int, str] | None:
        """(rank, report) of the first failed rank, or None."""
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None and not self._left(r):
                return r, f"rank {r} (pid {p.pid}) exited with status {code}"
        try:
            if self.store.check(["failed"]):  # another rank's monitor saw it first
                rank, _, why = self.store.get("failed").decode().partition(":")
                return int(rank), why
            self.store.add(f"hb/{self.rank}", 1)
            now = self.clock()
            for r in others:
                if self._left(r):
                    continue
                count = self.store.add(f"hb/{r}", 0)  # reads without blocking (a missing key is 0)
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.timeout_s:
                    return r, (f"rank {r} sent no heartbeat for {now - seen[r][1]:.1f} s (limit timeout_s="
                               f"{self.timeout_s:g}): it died or hangs")
        except Exception as e:  # the store is on rank 0 (or torchrun's agent): it is gone
            return 0, f"rank 0 (the job's store) stopped answering: {type(e).__name__}: {e}"
        return None

    def _left(self, r: int) -> bool:
        try:
            return self.store.check([f"bye/{r}"])
        except Exception:
            return False

    def _fail(self, rank: int, why: str) -> None:
        text = f"mpk tensor parallel: rank {self.rank} stops: {why}"
        try:  # the other ranks stop within a beat, naming the same rank
            self.store.compare_set("failed", "", f"{rank}:{why}")
        except Exception:  # the store is gone with rank 0: the others see that themselves
            pass
        # a hung worker of ours: ended before the failure is published, so whoever sees the
        # failure finds collectives with it failing at once
        if rank in self.procs:
            self.procs[rank].kill()
        with self._lock:
            self.failure = RankFailedError(text, rank)
            aborts = list(self._aborts)
        print(text, file=sys.stderr, flush=True)
        for abort in aborts:
            try:
                abort()
            except Exception as e:  # one failing abort must not keep the others from running
                print(f"mpk tensor parallel: an abort callback failed: {e!r}", file=sys.stderr, flush=True)
        if self.rank != 0 and self.exit_grace_s is not None:
            # a worker's main thread may be blocked on the dead peer (a receive, a kernel): end it
            timer = threading.Timer(self.exit_grace_s, os._exit, args=(1,))
            timer.daemon = True
            timer.start()
