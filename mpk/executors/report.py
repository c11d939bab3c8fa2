"""The watchdog's report: a pure function of the status rows the kernel publishes, the device
state read while it hung, and the tables (no CUDA here, so it is tested on the CPU).

The kernel's rows (runtime/mpk_runtime/types.cuh: StatusWord, WorkerState) are written from
the back-off branch of its waits: a worker waiting for its AOT head or at a started task's
gate names the task, the event, the counter it saw and the count it needs; a wait inside a
task body names the task and the wait; a scheduler warp names the JIT event its window waits
for. Rows are not reset between launches, so a worker that never backed off in this launch
shows an older state; the per-worker ``running`` word (epoch << 32 | task), stored whenever a
worker starts a task, names the task it is in regardless.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

STATUS_WORDS = 8  # types.cuh: kStatusWords
# types.cuh: StatusWord
ST_STATE, ST_TASK, ST_EVENT, ST_COUNT, ST_NEED, ST_AOT_POS, ST_JIT_HEAD, ST_SPINS = range(STATUS_WORDS)
# types.cuh: WorkerState
STARTING, WAITING_AOT, IDLE, EXITED, ABORTED, GATE, IN_TASK, SCHED_WAITING = range(8)
STATES = {STARTING: "starting", WAITING_AOT: "waiting for its AOT task", IDLE: "idle (no AOT work left)",
          EXITED: "exited", ABORTED: "aborted", GATE: "waiting at a task's gate", IN_TASK: "waiting inside a task",
          SCHED_WAITING: "waiting for a JIT event"}
TASK_WAITS = {1: "an mbarrier (copies into shared memory)", 2: "a busy spin",
              3: "a peer rank's signal (a collective: is every rank running?)"}  # common.cuh: TaskWait
MAX_LISTED = 6  # triggering tasks named per event, busy workers named in full


@dataclass
class ReportTables:
    """What the report needs of the tables: per task its op (-1: dummy), tile, dependent and
    trigger events; per event its num_triggers; op names and kinds; each worker's AOT queue;
    the event of each JIT index (a scheduler row's window slot)."""

    task_op: np.ndarray
    task_tile: np.ndarray
    task_dep: np.ndarray
    task_trig: np.ndarray
    event_triggers: np.ndarray
    op_names: Sequence[str]
    op_kinds: Sequence[str]
    worker_queues: Sequence[Sequence[int]]
    jit_events: Sequence[int] = ()

    @classmethod
    def from_tables(cls, t, worker_queues: Sequence[Sequence[int]], jit_events: Sequence[int] = ()) -> ReportTables:
        ops = t.meta["ops"]
        return cls(task_op=np.asarray(t.tasks["op"]), task_tile=np.asarray(t.tasks["tile"]),
                   task_dep=np.asarray(t.tasks["dep_event"]), task_trig=np.asarray(t.tasks["trig_event"]),
                   event_triggers=np.asarray(t.events["num_triggers"]), op_names=[o["name"] for o in ops],
                   op_kinds=[o["kind"] for o in ops], worker_queues=worker_queues, jit_events=list(jit_events))

    def describe(self, task: int) -> str:
        if not 0 <= task < len(self.task_op):
            return f"task {task} (not in the tables)"
        op = int(self.task_op[task])
        if op < 0:
            return f"task {task} (dummy)"
        return f"task {task} (op {self.op_names[op]!r} ({self.op_kinds[op]}) tile {int(self.task_tile[task])})"


@dataclass
class Snapshot:
    """The device state of one launch: ``status`` (workers' then schedulers' rows, as read from
    host-mapped memory while it hung), ``running`` (per worker, epoch << 32 | task) and
    ``counters`` (per event) when they could be read (None otherwise)."""

    epoch: int
    status: np.ndarray
    num_workers: int
    running: np.ndarray | None = None
    counters: np.ndarray | None = None


def _placement(tables: ReportTables) -> dict[int, tuple[int, int]]:
    return {int(task): (w, i) for w, q in enumerate(tables.worker_queues) for i, task in enumerate(q)}


def format_report(tables: ReportTables, snap: Snapshot, *, timeout_s: float, iterations: int,
                  exited: bool | None, stopped_with: int = 0) -> str:
    """The report of a launch that outlived ``timeout_s``. ``exited``: the kernel left after the
    abort (None: the report was written before it was asked to). ``stopped_with``: launches
    queued behind this one that the abort stopped too."""
    W = snap.num_workers
    rows = np.asarray(snap.status).reshape(-1, STATUS_WORDS).astype(np.int64)
    workers, scheds = rows[:W], rows[W:]
    where = _placement(tables)
    n_tasks = len(tables.task_op)
    lines = [f"mpk watchdog: the persistent kernel (launch {snap.epoch}) did not finish within {timeout_s:.1f} s "
             f"({n_tasks} tasks, {iterations} iteration(s), {W} workers, {len(scheds)} schedulers)."]

    def current(w: int) -> int | None:  # the task worker w last started in this launch
        if snap.running is None:
            return None
        word = int(snap.running[w]) & 0xFFFFFFFFFFFFFFFF
        return word & 0xFFFFFFFF if word >> 32 == snap.epoch else None

    waited: dict[int, list[int]] = {}  # event -> waiting workers
    needs: dict[int, int] = {}
    busy, others = [], Counter()
    for w in range(W):
        st = workers[w]
        state, task = int(st[ST_STATE]), int(st[ST_TASK])
        if state in (GATE, IN_TASK) and current(w) not in (None, task):
            state = STARTING  # the row is an earlier task's: the worker has started another since
        if state in (WAITING_AOT, GATE):
            e, have, need = int(st[ST_EVENT]), int(st[ST_COUNT]), int(st[ST_NEED])
            waited.setdefault(e, []).append(w)
            needs[e] = max(needs.get(e, 0), need)
            where_ = "at its input gate (the task started)" if state == GATE else "before taking it"
            head = f", JIT queue head {int(st[ST_JIT_HEAD])}" if state == WAITING_AOT else ""
            lines.append(f"  worker {w}: stuck before {tables.describe(task)} {where_}, AOT position "
                         f"{int(st[ST_AOT_POS])}{head}; waits on event {e} ({have}/{need} arrivals)")
        elif state == IN_TASK:
            what = TASK_WAITS.get(int(st[ST_EVENT]), f"wait {int(st[ST_EVENT])}")
            lines.append(f"  worker {w}: inside {tables.describe(task)}, waiting on {what} in its body "
                         f"({int(st[ST_SPINS])} back-offs)")
        elif state != IDLE and current(w) is not None:
            busy.append((w, current(w)))
        elif state != IDLE:
            others[STATES.get(state, f"in unknown state {state}")] += 1
    for w, task in busy[:MAX_LISTED]:
        lines.append(f"  worker {w}: running {tables.describe(task)} (started in this launch; no wait in it "
                     "backed off)")
    if len(busy) > MAX_LISTED:
        lines.append(f"  … and {len(busy) - MAX_LISTED} more worker(s) running a task")
    idle = int((workers[:, ST_STATE] == IDLE).sum())
    lines.append(f"  {idle} worker(s) idle with no AOT work left; others: "
                 + (", ".join(f"{n} {state}" for state, n in sorted(others.items())) or "none"))

    if len(scheds):
        sched_lines, sched_others = [], Counter()
        for s, st in enumerate(scheds):
            state = int(st[ST_STATE])
            if state == SCHED_WAITING:
                slot, e, fired, k = int(st[ST_TASK]), int(st[ST_EVENT]), int(st[ST_COUNT]), int(st[ST_NEED])
                sched_lines.append(f"    scheduler {s}: waits for JIT event {e} (JIT index {slot}) to fire in "
                                   f"iteration {k} (its mailbox: fired in iteration {fired}); handled mask "
                                   f"{int(st[ST_AOT_POS]) & 0xFFFFFFFF:#x}, {int(st[ST_SPINS])} back-offs")
            else:
                sched_others[STATES.get(state, f"in unknown state {state}")] += 1
        lines.append("  schedulers: " + (", ".join(f"{n} {state}" for state, n in sorted(sched_others.items()))
                                          or "all waiting"))
        lines.extend(sched_lines)

    if waited:
        source = "counters read from device memory while it hung" if snap.counters is not None else \
            "counters as the waiters last saw them"
        lines.append(f"  events waited on ({source}):")
        for e, ws in sorted(waited.items()):
            n = int(tables.event_triggers[e]) if 0 <= e < len(tables.event_triggers) else 0
            have = int(snap.counters[e]) if snap.counters is not None else \
                max(int(workers[w][ST_COUNT]) for w in ws)
            lines.append(f"    event {e}: counter {have}, needs {needs[e]} (fires at multiples of {n}); waiting "
                         f"workers {ws[:8]}{' …' if len(ws) > 8 else ''}")
            lines.append("      triggered by " + _triggers(tables, e, needs[e], n, workers, where))
    if exited is None:
        pass
    elif exited:
        lines.append("  the kernel observed the abort flag and exited: the process and its CUDA context stay "
                     "usable (intermediate buffers hold partial results; the launch's outputs are not valid).")
    else:
        lines.append("  the kernel did not exit within the wait after the abort request (a task itself does not "
                     "terminate); the CUDA context may be unusable until the process exits.")
    if stopped_with:
        lines.append(f"  {stopped_with} launch(es) queued behind it were stopped too (their outputs are not valid).")
    return "\n".join(lines)


def _triggers(tables: ReportTables, e: int, need: int, n: int, workers: np.ndarray,
              where: dict[int, tuple[int, int]]) -> str:
    """The tasks that arrive at event e, each with its worker and whether that worker has passed
    it in the iteration the waiters need (known only for a worker whose row shows a wait)."""
    tasks = np.nonzero(tables.task_trig == e)[0].tolist()
    if not tasks:
        return "no task (it can never fire)"
    k = max(1, -(-need // n)) if n > 0 else 1  # the iteration the waiters need
    parts = []
    pending = 0
    for task in tasks:
        if task not in where:
            parts.append((1, f"{tables.describe(task)} (JIT)"))
            continue
        w, i = where[task]
        st = workers[w] if w < len(workers) else None
        state = int(st[ST_STATE]) if st is not None else -1
        if state in (WAITING_AOT, GATE, IDLE):
            count = len(tables.worker_queues[w])
            done = int(st[ST_AOT_POS]) > (k - 1) * count + i
            if state in (WAITING_AOT, GATE) and int(st[ST_TASK]) == task:
                mark = "its worker waits before it"
            else:
                mark = "done" if done else "not yet run"
        elif state == IN_TASK and int(st[ST_TASK]) == task:
            mark, done = "its worker is inside it", False
        else:
            mark, done = "state unknown", False
        pending += not done
        parts.append((0 if not done else 2, f"{tables.describe(task)} on worker {w}: {mark}"))
    parts.sort(key=lambda p: p[0])  # the ones not done first
    shown = "; ".join(text for _, text in parts[:MAX_LISTED])
    more = f"; … {len(parts) - MAX_LISTED} more" if len(parts) > MAX_LISTED else ""
    return f"{len(tasks)} task(s), {pending} not known done: {shown}{more}"
