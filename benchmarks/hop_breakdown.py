"""Where a dependent-chain hop's time goes, from the in-kernel profiler: per task the span
(start → end: block barrier, task body, block barrier) and the gap (previous task's end → this
task's start: arrival atomic, the waiter's poll, its wake-up), for AOT chains (also kept on
one worker) and JIT chains (each task run by the worker that fired its event, and with that off:
every hop through a scheduler and a worker's ring). Medians over the chain.

    python benchmarks/hop_breakdown.py [--n 2000]
"""

from __future__ import annotations

import argparse

import numpy as np

from mpk.megakernel.gpu import GpuExecutor
from mpk.megakernel.stress import chain, force_jit, stamp_graph, stamp_inputs


def breakdown(n: int, jit: bool, workers: int | None, local_jit: bool = True) -> dict:
    tables = stamp_graph(chain(n), 1, record=False)
    if jit:
        force_jit(tables)
    ex = GpuExecutor(tables, profile=True, num_workers=workers, local_jit=local_jit)
    for _ in range(2):
        ex.run(stamp_inputs(tables, 1, "cuda"))
    spans = {e["args"]["task"]: (e["ts"], e["ts"] + e["dur"]) for e in ex.trace()["traceEvents"]}
    order = sorted(spans, key=lambda t: spans[t][0])
    starts = np.array([spans[t][0] for t in order]) * 1e3
    ends = np.array([spans[t][1] for t in order]) * 1e3
    return {"span_ns": float(np.median(ends - starts)), "gap_ns": float(np.median(starts[1:] - ends[:-1])),
            "per_task_ns": float((ends[-1] - starts[0]) / (n - 1))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    ns = p.parse_args()
    print(f"{'case':22s} {'span ns':>9s} {'gap ns':>9s} {'per task ns':>12s}")
    cases = (("aot", False, None, True), ("aot, 8 workers", False, 8, True), ("aot, one worker", False, 1, True),
             ("jit (local)", True, None, True), ("jit via scheduler", True, None, False),
             ("jit via sched., 8 wkrs", True, 8, False))
    for name, jit, workers, local in cases:
        r = breakdown(ns.n, jit, workers, local)
        print(f"{name:22s} {r['span_ns']:9.0f} {r['gap_ns']:9.0f} {r['per_task_ns']:12.0f}", flush=True)


if __name__ == "__main__":
    main()
