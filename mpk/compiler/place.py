"""Step 7a — place: how many workers and scheduler CTAs one launch has, and which worker runs
which AOT task in which order. Decided here once and written into the tables, so both
executors run the compiler's placement and decide none of their own.

Policy: AOT tasks go round-robin over the workers in linear order, so each queue is in linear
(topological) order and a worker never waits on a task queued behind it; consecutive tasks of
an op land on different workers. JIT tasks are not placed: scheduler warps hand them to
workers at run time. Scheduler CTAs default to ``DEFAULT_SCHEDULER_CTAS`` when the graph has
JIT tasks and to none otherwise (every CTA is then a worker). The worker count is the
``num_workers`` option, or, left to its default on a CUDA machine, every SM the scheduler CTAs
leave (a graph without JIT tasks then works on every SM). A CTA holds
``SCHED_WARPS_PER_CTA`` scheduler warps, and warp s owns workers w ≡ s (mod scheduler_warps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpk.errors import OptionError

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
              fill_sms: int | None = None) -> Placement:
    """The placement of tasks whose JIT flags, in linear order, are ``jit``. ``fill_sms``:
    instead of ``num_workers``, every one of that many SMs not taken by scheduler CTAs is a
    worker (options.num_workers left to its default: the launch fills the device)."""
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
    queues = [aot[w::num_workers] for w in range(num_workers)]
    offsets = np.zeros(num_workers + 1, np.int32)
    offsets[1:] = np.cumsum([len(q) for q in queues])
    tasks = np.concatenate(queues + [np.zeros(0, np.int32)]).astype(np.int32)
    return Placement(num_workers, scheduler_ctas, warps, offsets, tasks)


def place(tg: "TaskGraph", num_workers: int, scheduler_ctas: int | None = None,
          fill_sms: int | None = None) -> "TaskGraph":
    """Step 7a on the task graph (after linearize and modes): sets ``tg.placement``."""
    tg.placement = placement(np.array([tg.jit[t] for t in tg.task_order], dtype=bool), num_workers, scheduler_ctas,
                             fill_sms)
    return tg
