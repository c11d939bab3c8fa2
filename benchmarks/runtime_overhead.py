"""Runtime overhead of the persistent kernel (targets: AOT hop ≤ 1 µs, JIT hop ≤ 2 µs,
10^5 independent empty tasks ≤ 1 ms), with the peer measured in the same run: a CUDA graph of
dependent empty kernels (what a kernel-per-op executor pays per op).

Per-hop latency is the slope between two chain lengths (launch cost cancels); throughput is
the whole launch of 10^5 independent empty tasks (start-up included), beside a one-task launch. CUDA events, warm-up, median of repeats.
Prints one JSON line per measurement and a table last.

    python benchmarks/runtime_overhead.py [--out results.jsonl] [--repeats 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
from peer import require_cuda

from mpk.compiler.place import DEFAULT_SCHEDULER_CTAS
from mpk.compiler.tables import FLAG_JIT, place_tables
from mpk.executors.gpu import GpuExecutor
from mpk.options import default_num_workers
from mpk.testing.random_graphs import chain, force_jit, independent, stamp_graph, stamp_inputs


def _placed(tables, workers):
    """``tables`` on ``workers`` workers, or (None) on every SM its scheduler CTAs leave."""
    sched = DEFAULT_SCHEDULER_CTAS if (tables.tasks["flags"] & FLAG_JIT).any() else 0
    return place_tables(tables, workers or default_num_workers(sched), sched)


def time_launch(ex: GpuExecutor, inputs, repeats: int) -> float:
    """Median ms of one launch (one iteration): events recorded on the stream around the
    launch (the per-launch reset of counters and queues included), not around the host's wait."""
    for _ in range(3):
        ex.wait(ex.launch(inputs))
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        done = ex.launch(inputs)
        stop.record()
        ex.wait(done)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def graph_ms(preds, repeats: int, jit: bool = False, local_jit: bool = True) -> float:
    tables = stamp_graph(preds, 1, record=False)
    if jit:
        force_jit(tables)
    ex = GpuExecutor(_placed(tables, None), local_jit=local_jit)
    return time_launch(ex, stamp_inputs(tables, 1, "cuda"), repeats)


def cuda_graph_per_kernel_us(n: int, repeats: int) -> float:
    """Peer: a CUDA graph of n dependent tiny kernels; slope between n and n/4 kernels."""
    def replay_ms(k: int) -> float:
        x = torch.zeros(1, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(k):
                x.add_(1)
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    return (replay_ms(n) - replay_ms(n // 4)) / (n - n // 4) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON-lines file to append to")
    p.add_argument("--repeats", type=int, default=20)
    ns = p.parse_args()
    require_cuda("runtime_overhead.py")
    dev = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    rows = []

    def emit(name, value, unit, target=None, **extra):
        row = {"date": date, "device": dev, "bench": "runtime_overhead", "name": name, "value": round(value, 4),
               "unit": unit, "target": target, **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    n1, n2 = 500, 4500
    # jit: each event's single JIT task runs on the worker that fired it (the default);
    # jit_via_scheduler: the same chain with that off, every hop through a scheduler and a ring
    for mode in ("aot", "jit", "jit_via_scheduler"):
        jit, local = mode != "aot", mode == "jit"
        t1 = graph_ms(chain(n1), ns.repeats, jit=jit, local_jit=local)
        t2 = graph_ms(chain(n2), ns.repeats, jit=jit, local_jit=local)
        emit(f"{mode}_hop", (t2 - t1) / (n2 - n1) * 1e3, "us/hop", 1.0 if mode == "aot" else 2.0,
             chain_ms={n1: t1, n2: t2})
    t1, tb = graph_ms(independent(1), ns.repeats), graph_ms(independent(100_000), ns.repeats)
    emit("independent_1e5_launch", tb, "ms", 1.0, note="whole launch of 1e5 empty tasks, start-up included")
    emit("launch_1_task", t1, "ms", None, note="the same launch with one task: start-up and teardown")
    emit("peer_cuda_graph_kernel", cuda_graph_per_kernel_us(2000, ns.repeats), "us/kernel", None,
         note="CUDA graph of dependent empty kernels, same run")
    if ns.out:
        with open(ns.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"\n{'measurement':28s} {'value':>10s} {'unit':14s} {'target':>8s}")
    for r in rows:
        tgt = "" if r["target"] is None else f"<= {r['target']}"
        ok = "" if r["target"] is None else ("  ok" if r["value"] <= r["target"] else "  MISSED")
        print(f"{r['name']:28s} {r['value']:10.3f} {r['unit']:14s} {tgt:>8s}{ok}")


if __name__ == "__main__":
    main()
