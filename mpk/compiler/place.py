"""Step 7a — place: how many workers and scheduler CTAs one launch has, and which worker runs
which AOT task in which order. Decided here once and written into the tables, so both
executors run the compiler's placement and decide none of their own.

Policy: AOT tasks go round-robin over the workers in linear order, so each queue is in linear
(topological) order and a worker never waits on a task queued behind it; consecutive tasks of
an op land on different workers. An op whose tiles differ in work (``OpDef.tile_cost``: causal
attention over a prompt's rows) has its run of tasks dealt longest first, each to the least
loaded worker (LPT), and round-robin resumes after the run where it would have: the op's
events may each launch a whole wave of tiles (one per kv head), which round-robin would give
each worker the same rows of every head. JIT tasks are not placed: scheduler warps hand them to
workers at run time. Scheduler CTAs default to ``DEFAULT_SCHEDULER_CTAS`` when the graph has
JIT tasks and to none otherwise (every CTA is then a worker). The worker count is the
``num_workers`` option, or, left to its default on a CUDA machine, every SM the scheduler CTAs
leave (a graph without JIT tasks then works on every SM). A CTA holds
``SCHED_WARPS_PER_CTA`` scheduler warps, and warp s owns workers w ≡ s (mod scheduler_warps).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpk.errors import OptionError
from mpk.ops import get_op

if TYPE_CHECKING:
    from mpk.compiler.taskgraph import TaskGraph

SCHED_WARPS_PER_CTA = 4  # runtime/mpk_runtime/persistent.cuh: kSchedWarpsPerCta
MAX_WORKERS_PER_SCHEDULER = 136  # runtime/mpk_runtime/persistent.cuh: kMaxWorkersPerScheduler
DEFAULT_SCHEDULER_CTAS = 4  # 16 scheduler warps: at most 9 workers each on a 132-SM device


@dataclass(frozen=True)
class Placement:
    num_workers: int
    scheduler_ctas: int  # CTAs launched after the workers, SCHED_WARPS_PER_CTA scheduler warps each
    scheduler_warps: int  # the scheduler warps that own workers: min(launched warps, num_workers)
    worker_offsets: np.ndarray  # int32 [num_workers + 1]: worker w's queue is [offsets[w], offsets[w+1])
    worker_tasks: np.ndarray  # int32: AOT task ids (linear positions), each worker's queue in run order

    def meta(self) -> dict[str, int]:
        return {"num_workers": self.num_workers, "scheduler_ctas": self.scheduler_ctas,
                "scheduler_warps": self.scheduler_warps}


def check_counts(num_workers: object, scheduler_ctas: object) -> None:
    """OptionError naming the value unless ``num_workers`` is an int ≥ 1 and ``scheduler_ctas``
    None (the default for the graph) or an int ≥ 0."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise OptionError(f"num_workers={num_workers!r}; expected a positive int")
    if scheduler_ctas is not None and (not isinstance(scheduler_ctas, int) or isinstance(scheduler_ctas, bool)
                                       or scheduler_ctas < 0):
        raise OptionError(f"scheduler_ctas={scheduler_ctas!r}; expected None (4 when the graph has JIT tasks, "
                          "else 0) or an int >= 0")


def placement(jit: np.ndarray, num_workers: int, scheduler_ctas: int | None = None,
              fill_sms: int | None = None, costs: np.ndarray | None = None,
              groups: np.ndarray | None = None) -> Placement:
    """The placement of tasks whose JIT flags, in linear order, are ``jit``. ``fill_sms``:
    instead of ``num_workers``, every one of that many SMs not taken by scheduler CTAs is a
    worker (options.num_workers left to its default: the launch fills the device). ``costs``
    (NaN: none) and ``groups`` (the op of each task), in linear order: a run of consecutive AOT
    tasks of one group with costs is dealt by LPT."""
    check_counts(num_workers, scheduler_ctas)
    jit = np.asarray(jit, dtype=bool)
    n_jit = int(jit.sum())
    if scheduler_ctas is None:
        scheduler_ctas = DEFAULT_SCHEDULER_CTAS if n_jit else 0
    if fill_sms is not None:
        num_workers = max(1, fill_sms - scheduler_ctas)
    if n_jit and scheduler_ctas < 1:
        raise OptionError(f"scheduler_ctas={scheduler_ctas}, but the graph has {n_jit} JIT tasks, which scheduler "
                          "warps hand out; expected >= 1 (or None: 4)")
    warps = min(scheduler_ctas * SCHED_WARPS_PER_CTA, num_workers)
    if warps and -(-num_workers // warps) > MAX_WORKERS_PER_SCHEDULER:
        raise OptionError(f"num_workers={num_workers} over scheduler_ctas={scheduler_ctas} ({warps} scheduler warps) "
                          f"gives a scheduler more than {MAX_WORKERS_PER_SCHEDULER} workers; raise scheduler_ctas "
                          f"to at least {-(-num_workers // (MAX_WORKERS_PER_SCHEDULER * SCHED_WARPS_PER_CTA))}")
    aot = np.nonzero(~jit)[0].astype(np.int32)
    worker = np.arange(len(aot)) % num_workers
    if costs is not None:
        groups = np.zeros(len(jit), np.int64) if groups is None else np.asarray(groups)
        _deal_costly_runs(worker, np.asarray(costs, float)[aot], groups[aot], num_workers)
    queues = [aot[worker == w] for w in range(num_workers)]
    offsets = np.zeros(num_workers + 1, np.int32)
    offsets[1:] = np.cumsum([len(q) for q in queues])
    tasks = np.concatenate(queues + [np.zeros(0, np.int32)]).astype(np.int32)
    return Placement(num_workers, scheduler_ctas, warps, offsets, tasks)


def _deal_costly_runs(worker: np.ndarray, cost: np.ndarray, group: np.ndarray, num_workers: int) -> None:
    """Reassign, in place, each maximal run of consecutive tasks of one group with finite costs:
    longest first, each to the least loaded worker (ties: the one round-robin reaches first)."""
    k, n = 0, len(cost)
    while k < n:
        if not np.isfinite(cost[k]):
            k += 1
            continue
        end = k + 1
        while end < n and group[end] == group[k] and np.isfinite(cost[end]):
            end += 1
        first = int(worker[k])
        heap = [(0.0, (w - first) % num_workers, w) for w in range(num_workers)]
        for i in sorted(range(k, end), key=lambda i: (-cost[i], i)):
            load, turn, w = heapq.heappop(heap)
            worker[i] = w
            heapq.heappush(heap, (load + float(cost[i]), turn, w))
        k = end


def place(tg: "TaskGraph", num_workers: int, scheduler_ctas: int | None = None,
          fill_sms: int | None = None) -> "TaskGraph":
    """Step 7a on the task graph (after linearize and modes): sets ``tg.placement``."""
    order = tg.task_order
    costs = np.full(len(order), np.nan)
    for tiles in tg.tiles:
        cost = get_op(tg.graph.ops[tiles.op_id].kind).tile_cost
        # (NaN for the op's signature: alike, whatever the tile)
        if cost is not None and np.isfinite(cost(tiles.sig, tiles.tile_rect(0))):
            first = tiles.first_task
            for i in range(tiles.num_tasks):
                costs[first + i] = cost(tiles.sig, tiles.tile_rect(i))
    linear_costs = costs[order] if len(order) else costs
    groups = np.array([tg.task_op[t] for t in order], dtype=np.int64)
    tg.placement = placement(np.array([tg.jit[t] for t in order], dtype=bool), num_workers, scheduler_ctas,
                             fill_sms, linear_costs if np.isfinite(linear_costs).any() else None, groups)
    return tg
