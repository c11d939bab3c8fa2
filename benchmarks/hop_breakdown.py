"""Where a dependent-chain hop's time goes, from the in-kernel profiler: per task the span
(start → end: block barrier, task body, block barrier) and the gap (previous task's end → this
task's start: arrival atomic, the waiter's poll, its wake-up), for AOT chains (also kept on
one worker) and JIT chains (each task run by the worker that fired its event, and with that off:
every hop through a scheduler and a worker's ring). Medians over the chain.

``--clocks`` instead builds with ``-DMPK_HOP_CLOCKS`` (runtime/mpk_runtime/sync.cuh) and splits
an AOT hop by SM cycle counters, without the profiler's stores: the waiter's wake-up, the task
(body and barriers), the finisher's way to its release store, and the rest of the hop (the
store's way to the next waiter's poll), as means over the chain.

    python benchmarks/hop_breakdown.py [--n 2000] [--clocks]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from peer import require_cuda

from mpk.compiler.place import DEFAULT_SCHEDULER_CTAS
from mpk.compiler.tables import FLAG_JIT, place_tables
from mpk.executors import cuda_driver as drv
from mpk.executors.gpu import GpuExecutor
from mpk.options import default_num_workers
from mpk.testing.random_graphs import chain, force_jit, stamp_graph, stamp_inputs


def _placed(tables, workers):
    """``tables`` on ``workers`` workers, or (None) on every SM its scheduler CTAs leave."""
    sched = DEFAULT_SCHEDULER_CTAS if (tables.tasks["flags"] & FLAG_JIT).any() else 0
    return place_tables(tables, workers or default_num_workers(sched), sched)


def breakdown(n: int, jit: bool, workers: int | None, local_jit: bool = True) -> dict:
    tables = stamp_graph(chain(n), 1, record=False)
    if jit:
        force_jit(tables)
    ex = GpuExecutor(_placed(tables, workers), profile=True, local_jit=local_jit)
    for _ in range(2):
        ex.run(stamp_inputs(tables, 1, "cuda"))
    spans = {e["args"]["task"]: (e["ts"], e["ts"] + e["dur"]) for e in ex.trace()["traceEvents"]}
    order = sorted(spans, key=lambda t: spans[t][0])
    starts = np.array([spans[t][0] for t in order]) * 1e3
    ends = np.array([spans[t][1] for t in order]) * 1e3
    return {"span_ns": float(np.median(ends - starts)), "gap_ns": float(np.median(starts[1:] - ends[:-1])),
            "per_task_ns": float((ends[-1] - starts[0]) / (n - 1))}


HOP_FIELDS = 8  # sync.cuh: kHopFields (wake, task, release sums; hops; cycles; ns)


def clocks(n: int, workers: int | None, repeats: int = 5) -> dict:
    """Mean ns per hop of each stretch (SM cycles scaled by each worker's cycles per ns)."""
    tables = stamp_graph(chain(n), 1, record=False)
    ex = GpuExecutor(_placed(tables, workers))
    ptr, nbytes = ex.module.global_ptr("mpk_hop_cycles")
    inputs = stamp_inputs(tables, 1, "cuda")
    ex.run(inputs)  # warm-up
    acc = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    sums = np.zeros(4)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total_ms = 0.0
    for _ in range(repeats):
        drv.memset_d32_async(ptr, 0, nbytes // 4, stream)
        start.record()
        ex.run(inputs)
        stop.record()
        stop.synchronize()
        total_ms += start.elapsed_time(stop)
        drv.copy_device_async(acc.data_ptr(), ptr, nbytes, stream)
        torch.cuda.synchronize()
        t = acc.cpu().numpy().reshape(-1, HOP_FIELDS)
        t = t[t[:, 3] > 0]
        per_ns = t[:, 4] / np.maximum(t[:, 5], 1)  # cycles per ns, per worker
        sums += np.array([(t[:, f] / per_ns).sum() for f in range(3)] + [t[:, 3].sum()])
    hops = sums[3]
    wake, task, release = (sums[:3] / hops).tolist()
    return {"wake_ns": wake, "task_ns": task, "release_ns": release,
            "launch_per_task_ns": total_ms * 1e6 / repeats / n}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--clocks", action="store_true", help="split AOT hops by SM cycle counters")
    ns = p.parse_args()
    require_cuda("hop_breakdown.py")
    if ns.clocks:
        flags = os.environ.get("MPK_NVCC_FLAGS", "")
        if "-DMPK_HOP_CLOCKS" not in flags.split():
            os.environ["MPK_NVCC_FLAGS"] = (flags + " -DMPK_HOP_CLOCKS").strip()
        print(f"{'case':22s} {'wake ns':>9s} {'task ns':>9s} {'release ns':>11s} {'launch/task ns':>15s}")
        for name, workers in (("aot", None), ("aot, 8 workers", 8)):  # one worker finds its events fired: no gate
            r = clocks(ns.n, workers)
            print(f"{name:22s} {r['wake_ns']:9.0f} {r['task_ns']:9.0f} {r['release_ns']:11.0f} "
                  f"{r['launch_per_task_ns']:15.0f}", flush=True)
        return
    print(f"{'case':22s} {'span ns':>9s} {'gap ns':>9s} {'per task ns':>12s}")
    cases = (("aot", False, None, True), ("aot, 8 workers", False, 8, True), ("aot, one worker", False, 1, True),
             ("jit (local)", True, None, True), ("jit via scheduler", True, None, False),
             ("jit via sched., 8 wkrs", True, 8, False))
    for name, jit, workers, local in cases:
        r = breakdown(ns.n, jit, workers, local)
        print(f"{name:22s} {r['span_ns']:9.0f} {r['gap_ns']:9.0f} {r['per_task_ns']:12.0f}", flush=True)


if __name__ == "__main__":
    main()
