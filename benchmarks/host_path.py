"""Where the host's time to issue one decode step goes (the launch path, not the kernel).

A step whose host time exceeds its GPU time is host-bound: the GPU waits between steps and a
CUDA-event timing of the step counts the wait. For each model and batch this compiles the step
as ``decode_latency.py`` does, then times, in µs per call (median of ``--rounds`` blocks of
``--calls`` back-to-back calls, no synchronisation inside a block), each layer of the path on its
own, outermost first:

- ``step``: ``step(tokens, *kv.args())``, what a decode loop calls (torch.compile's guards and
  wrappers, AOT autograd's runtime wrapper, mpk's runner); ``step_unguarded`` the same under
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, which skips dynamo's guards;
- ``runner``: mpk's runner on the flat arguments AOT autograd passes it (launch and outputs);
- ``launch``: ``GpuExecutor.launch`` alone (input checks, binding, arguments, the reset copy,
  the driver launch, the done-event);
- ``bind``: ``GpuExecutor._bind`` alone (its fast path: the arguments bound last time);
- ``driver``: the counters' reset copy and the cooperative kernel launch alone, and
  ``driver_plain`` the same with the ordinary launch (stream order keeps it from overlapping
  another launch, so all its CTAs are resident as the cooperative launch guarantees);

and the step's GPU time (CUDA events, as ``decode_latency.py``). With ``--cprofile`` the step
also runs under cProfile and the functions taking most of its own time are printed.

``torchrun --nproc-per-node N benchmarks/host_path.py --tp N``: every rank compiles its shard of
the step (over a rank-local cache, as the engine does) and runs the same calls (a rank's kernel
waits for its peers'); rank 0 reports ``step`` and ``step_unguarded`` (the layers below the
runner differ under tensor parallelism: the binder and the sharded runner wrap the executor)
and the profile.
Prints one JSON line per configuration (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import add_step_args, check_tp, compile_step, emit_row, max_len, random_model, run_in_job  # noqa: E402
from peer import require_cuda, time_step  # noqa: E402

from mpk.backend import COMPILED, RUNNERS, last_args  # noqa: E402
from mpk.cli import count  # noqa: E402
from mpk.executors import cuda_driver as drv  # noqa: E402
from mpk.executors.gpu import THREADS  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402


def host_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean µs per call of ``calls`` back-to-back calls of ``fn``
    (the GPU drained before each round, so a full launch queue never blocks the host)."""
    per_round = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_round)


def top_functions(fn: Callable[[], object], calls: int, limit: int) -> list[dict]:
    """cProfile of ``calls`` calls of ``fn``: the ``limit`` functions with the most own time,
    µs per call of ``fn``."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "own_us": tottime / calls * 1e6,
                     "cum_us": cumtime / calls * 1e6, "calls_per_step": ncalls / calls})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:limit]


def measure(model, batch: int, position: int, page_size: int, calls: int, rounds: int,
            cprofile: int, tp: tuple[int, int] | None = None) -> dict:
    step, kv = compile_step(model, batch, position, page_size, {"tensor_parallel": tp} if tp else None)
    tokens = torch.randint(0, model.cfg.vocab, (batch,), device="cuda")
    with torch.no_grad():
        kv.local.normal_()
        step(tokens, *kv.args())  # trace, compile, build
        torch.cuda.synchronize()
        if tp is not None:
            return measure_step(lambda: step(tokens, *kv.args()), calls, rounds, cprofile)
        compiled = COMPILED[-1]
        runner = RUNNERS[id(compiled)]
        flat = last_args(runner)
        ex = runner.state["ex"]
        stream = torch.cuda.current_stream().cuda_stream

        def full():
            step(tokens, *kv.args())

        def run():
            runner(*flat)

        def launch():
            ex.launch(flat)

        def driver(cooperative: bool):
            def call():  # the counters' reset and the kernel, as GpuExecutor.launch issues them
                drv.copy_device_async(ex.d_zero.data_ptr(), ex.d_reset.data_ptr(), 8 * ex.d_zero.numel(), stream)
                drv.launch(ex.kernel, ex.grid, THREADS, stream, ex._launch_params, cooperative=cooperative,
                           smem=ex.smem)
            return call

        result = {"gpu_ms": time_step(full, warmup=5, iters=30),
                  "step_us": host_us(full, calls, rounds)}
        # dynamo's guards skipped (the caller vouches nothing they check changes between steps)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            result["step_unguarded_us"] = host_us(full, calls, rounds)
        result |= {"kv_args_us": host_us(kv.args, calls, rounds),
                   "runner_us": host_us(run, calls, rounds),
                   "launch_us": host_us(launch, calls, rounds),
                   "bind_us": host_us(lambda: ex._bind(flat), calls, rounds),
                   "driver_us": host_us(driver(True), calls, rounds),
                   "driver_plain_us": host_us(driver(False), calls, rounds),
                   "args": len(flat)}
        ex.outputs()  # the launches above took none: let go of the pass-through arguments
        if cprofile:
            result["top"] = top_functions(full, cprofile, 25)
    torch._dynamo.reset()  # the step, its runner and executor go with this frame
    return result


def measure_step(full: Callable[[], object], calls: int, rounds: int, cprofile: int) -> dict:
    """The outer layers only (a tensor-parallel rank's step), the rest None."""
    result = {"gpu_ms": time_step(full, warmup=5, iters=30), "step_us": host_us(full, calls, rounds)}
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        result["step_unguarded_us"] = host_us(full, calls, rounds)
    result |= dict.fromkeys(("kv_args_us", "runner_us", "launch_us", "bind_us", "driver_us", "driver_plain_us"))
    result["args"] = len(COMPILED[-1].sharded.inputs)
    if cprofile:
        result["top"] = top_functions(full, cprofile, 25)
    torch._dynamo.reset()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per timed block")
    ap.add_argument("--rounds", type=int, default=7, help="timed blocks per measurement (their median)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="profile N steps under cProfile")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tp", type=count(1), default=1, help="tensor-parallel degree (under torchrun --nproc-per-node N)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        ap.error(f"--calls {args.calls} and --rounds {args.rounds} must be at least 1")
    problem = check_tp(args.tp, args.models)
    if problem:
        print(f"host_path.py: {problem}", file=sys.stderr)
        return 1
    require_cuda("host_path.py")
    return run_in_job(args.tp, lambda job: run(args, job))


def run(args, job) -> int:
    tp = (job.rank, job.world) if job is not None else None
    if tp is not None and tp[0] != 0:  # rank 0 prints and writes the rows (every rank makes the same calls)
        args.out = None
    device = torch.cuda.get_device_name()
    rows = []
    for name in args.models:
        model = random_model(MODELS[name], max_len(args.position), num_splits=args.num_splits)
        for batch in args.batches:
            r = measure(model, batch, args.position, args.page_size, args.calls, args.rounds, args.cprofile, tp)
            row = {"date": datetime.date.today().isoformat(), "device": device, "model": name, "batch": batch,
                   "position": args.position, "tp": args.tp, **r}
            rows.append(row)
            if tp is not None and tp[0] != 0:
                continue
            for t in row.get("top", []):
                print(f"  {t['own_us']:8.1f} own {t['cum_us']:8.1f} cum µs/step  x{t['calls_per_step']:<6.1f} "
                      f"{t['function']}", flush=True)
            emit_row(row, args.out)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if tp is not None and tp[0] != 0:
        return 0
    cols = ("step_us", "step_unguarded_us", "kv_args_us", "runner_us", "launch_us", "bind_us", "driver_us",
            "driver_plain_us")
    print(f"\n{'model':12s} {'B':>3s} {'args':>5s} {'gpu ms':>8s} " + " ".join(f"{c[:-3]:>12s}" for c in cols)
          + "   (host µs per call)")
    for r in rows:
        print(f"{r['model']:12s} {r['batch']:3d} {r['args']:5d} {r['gpu_ms']:8.3f} "
              + " ".join(f"{r[c]:12.1f}" if r[c] is not None else f"{'-':>12s}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
