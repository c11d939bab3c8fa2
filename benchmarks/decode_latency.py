"""Decode-step latency: mpk's megakernel against the torch peer and the bandwidth floor, in one
run on one device (the numbers of docs/performance.md).

For each model shape and batch size: ``DecoderLM`` with random bf16 weights compiled with
``torch.compile(backend="mpk")`` (one persistent-kernel launch per step), timed at position 64
(a 64-token prompt already in the paged cache, random K/V); the gpt-fast-style peer
(``peer.time_peer``: eager, eager + CUDA graph, torch.compile + CUDA graph) on the same shape;
the floor = (weights + KV read) / measured copy bandwidth. With ``--profile`` one extra step
runs under the in-kernel profiler and the step's time is split by task type: for each op the
span from its first task's start to its last task's end, summed per kind; what is left of the
step is event hops and ramp-up/down.

Prints one JSON line per configuration (also appended to ``--out``) and a table last.

Tensor parallelism: ``torchrun --nproc-per-node N benchmarks/decode_latency.py --tp N``. Every
rank compiles its shard (the ``tensor_parallel`` compile option; NVSHMEM for the all-reduces)
and the peer shards the same way with NCCL's all-reduce (``peer.PeerDecoder.shard_``); the
ranks step in lockstep and rank 0 prints the slowest rank's median. Fewer than N visible GPUs:
a message and exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import (Shape, copy_bandwidth, floor_ms, kv_bytes, require_cuda, time_peer, time_step,  # noqa: E402
                  tp_shape, weight_bytes)

from mpk.backend import COMPILED, RUNNERS, last_args  # noqa: E402
from mpk.cli import count, json_object, page_size as page_size_arg  # noqa: E402
from mpk.errors import OptionError  # noqa: E402
from mpk.ops.linalg import op_form  # noqa: E402
from mpk.options import CompileOptions  # noqa: E402
from mpk.executors.timeline import breakdown as timeline_breakdown  # noqa: E402
from mpk.executors.timeline import timeline_svg  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache  # noqa: E402


def random_model(cfg: LLMConfig, max_len: int, seed: int = 0, num_splits: int = 0) -> DecoderLM:
    """Random bf16 weights drawn on the GPU (scale 0.02; norm weights near 1)."""
    model = DecoderLM(cfg, torch.bfloat16, "cuda", max_len=max_len, num_splits=num_splits)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    return model


def peer_shape(name: str) -> Shape:
    """The peer's shape of the model ``name`` (any of ``mpk.llm.SHAPES``)."""
    c = MODELS[name]
    return Shape(name, c.hidden, c.inter, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab, c.tied, c.qk_norm,
                 c.rope_theta, c.eps)


def breakdown(compiled, trace_path: Path | None = None, profile_capacity: int = 4096) -> dict:
    """Per op kind: summed spans of its ops in one profiled step (µs), plus the rest; the
    median task duration per kind (``mpk.executors.timeline.breakdown``) and one layer's
    stages. ``trace_path``: also write the Perfetto trace there and its timeline beside it
    (``.svg``); ``profile_capacity``: records a worker holds."""
    from mpk.executors.gpu import GpuExecutor

    runner = RUNNERS[id(compiled)]
    ex = GpuExecutor(compiled.tables, profile=True, profile_capacity=profile_capacity)
    ex.run(last_args(runner))
    doc = ex.trace(trace_path)
    if trace_path is not None:
        timeline_svg(doc, trace_path.with_suffix(".svg"), title=trace_path.stem)
    out = timeline_breakdown(doc)
    del out["tasks"]
    out["stages"] = stages(doc["traceEvents"], compiled.tables)
    return out


def stages(trace: list[dict], t, first: int = 10, count: int = 12) -> list[dict]:
    """One layer's timeline: ops ``first``…``first + count`` in start order, each with its kind,
    task count, the gap since the previous op's last task ended (the event hop and ramp-up),
    its span, its median / longest task, and the spread of its tasks' starts (first to last
    gate opening: tasks whose workers were still busy, or slow to come back, start late) (µs).
    A trace of a ``-DMPK_HOP_STAMPS`` build adds ``late_hop``: for the op's three latest
    starters, the median way from their worker's previous task — its end to the worker having
    this task in hand (the arrival, next_task), on to the task reaching its gate (dispatch and
    the loads before the gate), and to the gate opening (the poll)."""
    per_op: dict[int, list[dict]] = defaultdict(list)
    per_worker: dict[int, list[dict]] = defaultdict(list)
    for e in trace:
        op = int(t.tasks[e["args"]["task"]]["op"])
        if op >= 0:  # dummy tasks, which thread 0 completes in passing, are part of a hop
            per_op[op].append(e)
            per_worker[e["args"]["worker"]].append(e)
    prev_end = {}  # task → the end of its worker's previous task
    for es in per_worker.values():
        es.sort(key=lambda e: e["ts"])
        for a, b in zip(es, es[1:]):
            prev_end[b["args"]["task"]] = a["ts"] + a["dur"]
    order = sorted(per_op, key=lambda op: min(e["ts"] for e in per_op[op]))
    rows, last_end = [], None
    for op in order[first: first + count]:
        es = per_op[op]
        lo, hi = min(e["ts"] for e in es), max(e["ts"] + e["dur"] for e in es)
        durs = sorted(e["dur"] for e in es)
        row = {"kind": op_form(t.meta["ops"][op]["kind"], t.meta["ops"][op].get("attrs", {})), "tasks": len(es),
               "gap": round(lo - last_end, 2) if last_end is not None else None,
               "span": round(hi - lo, 2), "median": round(durs[len(durs) // 2], 2), "max": round(durs[-1], 2),
               "start_spread": round(max(e["ts"] for e in es) - lo, 2)}
        late = [e for e in sorted(es, key=lambda e: e["ts"])[-3:] if "gate" in e["args"] and e["args"]["task"] in prev_end]
        if late:
            def med(xs: list[float]) -> float:
                return round(sorted(xs)[len(xs) // 2], 2)
            row["late_hop"] = {"end_ready": med([e["args"]["ready"] - prev_end[e["args"]["task"]] for e in late]),
                               "ready_gate": med([e["args"]["gate"] - e["args"]["ready"] for e in late]),
                               "gate_open": med([e["ts"] - e["args"]["gate"] for e in late])}
        rows.append(row)
        last_end = hi
    return rows


_ENV_FLAGS = os.environ.get("MPK_NVCC_FLAGS", "")


def build_options(text: str) -> dict:
    """An argparse type: a JSON object of mpk compile options plus an optional ``"nvcc_flags"``
    string, checked when the command line is read (not after minutes of tracing)."""
    options = json_object(text)
    flags = options.get("nvcc_flags", "")
    if not isinstance(flags, str):
        raise argparse.ArgumentTypeError(f"{text!r}: \"nvcc_flags\" is {flags!r}; expected one string of flags, "
                                         'e.g. "-DMPK_PHASES -lineinfo"')
    try:
        CompileOptions.parse({"executor": "gpu", **{k: v for k, v in options.items() if k != "nvcc_flags"}})
    except OptionError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return options


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The arguments that pick the benchmarked decode steps (shared with prebuild_decode.py,
    whose cubins must be these steps')."""
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-1.7b", "qwen3-8b"],
                    choices=sorted(MODELS), metavar="MODEL", help=f"any of {', '.join(sorted(MODELS))}")
    ap.add_argument("--batches", nargs="+", type=count(1), default=[1, 4, 16], help="batch sizes")
    ap.add_argument("--position", type=count(0), default=64, help="tokens already in each sequence's cache")
    ap.add_argument("--page-size", type=page_size_arg, default=16, help="KV-cache page size")
    ap.add_argument("--num-splits", type=count(0), default=0,
                    help="attention's KV chunks per sequence, at most (0: the compiler's default_splits)")


def max_len(position: int) -> int:
    """The models' cache length: the prompt and 64 more tokens."""
    return position + 64


def emit_row(row: dict, out: Path | None) -> None:
    """Print ``row`` as one JSON line, and append it to ``out`` if given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with out.open("a") as fh:
            fh.write(line + "\n")


def compile_step(model: DecoderLM, batch: int, position: int, page_size: int, options: dict | None = None):
    """The benchmarked step: the cache holding ``position`` tokens plus the one being decoded,
    and the model compiled for the GPU executor (asynchronous launches). Returns (step, kv).
    ``options``: mpk compile options, plus an optional ``"nvcc_flags"`` string that becomes
    ``$MPK_NVCC_FLAGS`` for this step's build (an A/B of a compile-time switch; the cubin cache
    keys on the flags)."""
    options = dict(options or {})
    os.environ["MPK_NVCC_FLAGS"] = options.pop("nvcc_flags", _ENV_FLAGS)
    # a tensor-parallel rank's cache is rank-local, as the engine's: its step copies nothing
    kv = PagedKVCache(model, batch, position + 1, page_size, tensor_parallel=options.get("tensor_parallel"))
    kv.grow(position + 1)
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu", "sync": False, **options})
    return step, kv


def bench_mpk(model: DecoderLM, batch: int, position: int, page_size: int, profile: bool,
              trace_path: Path | None = None, options: dict | None = None) -> dict:
    tp = (options or {}).get("tensor_parallel")
    step, kv = compile_step(model, batch, position, page_size, options)
    with torch.no_grad():
        kv.local.normal_()
    tokens = torch.randint(0, model.cfg.vocab, (batch,), device="cuda")
    with torch.no_grad():
        step(tokens, *kv.args())  # trace, compile, build
        torch.cuda.synchronize()
        if tp is not None:
            torch.distributed.barrier()  # the ranks' timed steps wait for each other's signals
        ms = slowest(time_step(lambda: step(tokens, *kv.args()), warmup=5, iters=30), tp)
        # the host's time to issue a step (torch.compile's guards and wrappers, the executor's
        # binding and launch): a step whose host_ms exceeds its GPU time is host-bound
        t0 = time.perf_counter()
        for _ in range(20):
            step(tokens, *kv.args())
        host_ms = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        compiled = COMPILED[-1]
        result = {"mpk_ms": ms, "host_ms": host_ms, "tasks": len(compiled.tables.tasks),
                  "events": len(compiled.tables.events)}
        if profile:
            result["breakdown_us"] = breakdown(compiled, trace_path)
    del step
    torch._dynamo.reset()
    return result


def slowest(ms: float, tp: tuple[int, int] | None) -> float:
    """The slowest rank's ``ms`` in a tensor-parallel job (a step ends when its last rank does)."""
    if tp is None or tp[1] == 1:
        return ms
    every: list[float] = [0.0] * tp[1]
    torch.distributed.all_gather_object(every, ms)
    return max(every)


def check_tp(tp: int, models: list[str], visible: int | None = None) -> str | None:
    """Why ``--tp`` cannot run here (a model's sizes it does not divide, fewer visible GPUs
    than ranks, not started by torchrun), or None."""
    if tp == 1:
        return None
    for name in models:
        try:
            tp_shape(peer_shape(name), tp)
        except ValueError as e:
            return str(e)
    visible = torch.cuda.device_count() if visible is None else visible
    if visible < tp:
        return f"--tp {tp} needs {tp} GPUs, one per rank; {visible} visible (CUDA_VISIBLE_DEVICES=" \
               f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
    if os.environ.get("WORLD_SIZE") != str(tp):
        return (f"--tp {tp} runs one rank per GPU under torchrun (WORLD_SIZE={os.environ.get('WORLD_SIZE')}): "
                f"torchrun --nproc-per-node {tp} benchmarks/decode_latency.py --tp {tp} ...")
    return None


def join_tp(tp: int):
    """This torchrun rank's job, joined (NCCL for the peer's all-reduces, NVSHMEM for mpk's), on
    the GPU of its local rank; None for --tp 1."""
    if tp == 1:
        return None
    from mpk.distributed.launch import RankInfo, join
    from mpk.distributed.nvshmem import init_nvshmem

    info = RankInfo.from_env()
    torch.cuda.set_device(info.local_rank)
    job = join(info, backend="nccl")
    init_nvshmem(job.control)
    return job


def run_in_job(tp: int, body) -> int:
    """``body(job)`` in this rank's job (``join_tp``; None for --tp 1), left afterwards."""
    job = join_tp(tp)
    try:
        return body(job)
    finally:
        if job is not None:
            from mpk.distributed.nvshmem import leave

            leave(job)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--compile-mode", default="default",
                    help="the peer's torch.compile mode (max-autotune costs minutes per shape)")
    ap.add_argument("--profile", action="store_true", help="per-task-type breakdown of one mpk step")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="write each profiled step's Perfetto trace here (with --profile)")
    ap.add_argument("--options", nargs="+", type=build_options, default=[{}],
                    help='extra mpk compile options as JSON, e.g. \'{"fuse_norm_prologue": false}\' or '
                         '\'{"nvcc_flags": "-DMPK_X"}\'; several: an A/B of builds, timed in turn on the same '
                         'model and inputs')
    ap.add_argument("--rounds", type=count(1), default=1, help="time every --options build this many times, alternating")
    ap.add_argument("--skip-peer", action="store_true", help="mpk alone (for comparing mpk builds; no speedup)")
    ap.add_argument("--tp", type=count(1), default=1, help="tensor-parallel degree: one rank per GPU, started by "
                                                           "torchrun --nproc-per-node N")
    args = ap.parse_args(argv)
    if args.trace_dir and not args.profile:
        ap.error("--trace-dir writes the profiled steps' traces: add --profile")
    problem = check_tp(args.tp, args.models)
    if problem:
        print(f"decode_latency.py: {problem}", file=sys.stderr)
        return 1
    require_cuda("decode_latency.py", "benchmarks/prebuild_decode.py builds its kernels without one")
    return run_in_job(args.tp, lambda job: run(args, job))


def run(args, job) -> int:
    tp = (job.rank, job.world) if job is not None else None
    if tp is not None:
        args.options = [{**o, "tensor_parallel": tp} for o in args.options]
        if tp[0] != 0:  # rank 0 prints and writes the rows
            sys.stdout, args.out = open(os.devnull, "w"), None
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"device {device}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in args.models:
        cfg, shape = MODELS[name], peer_shape(name)
        model = random_model(cfg, max_len(args.position), num_splits=args.num_splits)
        for batch in args.batches:
            peer = (dict.fromkeys(("eager_ms", "eager_graph_ms", "compile_graph_ms", "peer_ms", "peer_mode"), None)
                    | {"errors": {}} if args.skip_peer else time_peer(shape, batch, args.position,
                                                                      compile_mode=args.compile_mode, tp=tp))
            if tp is not None and peer["peer_ms"] is not None:
                peer["peer_ms"] = slowest(peer["peer_ms"], tp)
            rank_shape = tp_shape(shape, args.tp)  # the bytes one rank reads
            floor = floor_ms(weight_bytes(rank_shape) + kv_bytes(rank_shape, batch, args.position + 1), bw)
            for rnd in range(args.rounds):
                for v, options in enumerate(args.options):
                    tag = f"{name}-b{batch}" + (f"-v{v}" if len(args.options) > 1 else "") + (f"-r{rnd}" if rnd else "")
                    trace = args.trace_dir / f"{tag}.json" if args.trace_dir else None
                    mpk = bench_mpk(model, batch, args.position, args.page_size, args.profile, trace, options)
                    flags = os.environ["MPK_NVCC_FLAGS"]
                    row = {"date": datetime.date.today().isoformat(), "device": device, "model": name, "batch": batch,
                           "tp": args.tp,
                           "position": args.position, "page_size": args.page_size, "num_splits": args.num_splits,
                           "nvcc_flags": flags, "options": options, "round": rnd, **mpk,
                           **{k: peer[k] for k in ("eager_ms", "eager_graph_ms", "compile_graph_ms", "peer_ms",
                                                   "peer_mode", "errors")},
                           "speedup": peer["peer_ms"] / mpk["mpk_ms"] if peer["peer_ms"] else None,
                           "floor_ms": floor, "floor_util": floor / mpk["mpk_ms"], "peer_floor_util":
                           floor / peer["peer_ms"] if peer["peer_ms"] else None, "bandwidth_GBps": bw / 1e9}
                    rows.append(row)
                    for st in row.get("breakdown_us", {}).get("stages", []):
                        hop = st.get("late_hop")
                        print("  {kind:14s} tasks {tasks:4d}  gap {gap!s:>6}  span {span:7.2f}  median {median:6.2f}  "
                              "max {max:6.2f}  start spread {start_spread:5.2f}".format(**st)
                              + ("  late hop: end→ready {end_ready:.2f} ready→gate {ready_gate:.2f} gate→open "
                                 "{gate_open:.2f}".format(**hop) if hop else ""), flush=True)
                    emit_row(row, args.out)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'model':12s} {'B':>3s} {'mpk ms':>8s} {'peer ms':>8s} {'peer':>13s} {'speedup':>8s} "
          f"{'floor ms':>9s} {'floor_util':>10s} {'host ms':>8s}" + ("  options" if len(args.options) > 1 else ""))
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['model']:12s} {r['batch']:3d} {r['mpk_ms']:8.3f} {r['peer_ms'] or float('nan'):8.3f} "
              f"{str(r['peer_mode']):>13s} {sp:>8s} {r['floor_ms']:9.3f} {r['floor_util']:10.2f} {r['host_ms']:8.3f}"
              + (f"  {json.dumps(r['options'])}" if len(args.options) > 1 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
