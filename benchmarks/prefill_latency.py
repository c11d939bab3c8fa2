"""Prefill latency (time to first token): mpk's megakernel against the torch peer, in one run on
one device.

For each model shape: ``DecoderLM`` with random bf16 weights, compiled for the token-count
buckets the cases need (``mpk.llm.TokenBuckets``, one persistent-kernel launch per step), and
the gpt-fast-style peer's prefill (``peer.time_peer_prefill``: cuBLAS GEMMs and SDPA's causal
flash attention, one padded batch; eager, eager + CUDA graph, torch.compile + CUDA graph, the
best of them). Cases: one prompt of each ``--lengths`` (batch 1), and one step holding the
``--mixed`` prompts together (the peer pads them to the longest). TTFT is the step from an
empty cache to the logits of each prompt's last token, timed with CUDA events around the call
(back to back, as a serving loop issues them: host work that outlasts the GPU shows). Also:
a decode step of ``--decode-batch`` sequences alone and with a ``--chunk``-token prefill chunk
riding in it (the decode TPOT a chunked prefill costs); and a decode step of 16 sequences, one
``--skew-long`` positions long and 15 short, in the decode form (each sequence split alike) and
as a ragged step (attention's balanced split, ``skewed_decodes``). ``model TFLOP/s`` counts the matmuls'
FLOPs (``matmul_flops``; attention's excluded) over the step's time, against the dense bf16 peak
measured by cuBLAS in the same run. ``--profile``: each prompt case's step once more under the
in-kernel profiler, its time split by op kind and one layer's stages (``decode_latency.breakdown``)
in the row; the table shows the stages.

``--prebuild`` traces every step and builds its kernels into ``$MPK_CACHE_DIR`` without a GPU
(as ``prebuild_decode.py`` does for the decode benchmark); ``--parts`` and ``--lengths`` pick
the cases, so several ``--prebuild`` processes (a length each) build in parallel. The model's
length is the longest of ``--lengths``, ``--mixed``, ``--chunk`` + ``--position`` and
``--skew-long`` (16,384 by default, the longest): a process whose longest differs from the timed
run's builds other kernels. Prints one JSON line per case (also
appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import breakdown, emit_row, peer_shape  # noqa: E402
from gemm_tflops import dense_peak_tflops  # noqa: E402
from peer import require_cuda, time_peer_prefill  # noqa: E402

from mpk.cli import count  # noqa: E402
from mpk.cli import page_size as page_size_arg  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402
from mpk.llm import DecoderLM, PagedKVCache, TokenBuckets, prefill  # noqa: E402

MIXED = [2048, 1024, 512, 512, 256, 128, 64, 64]
PARTS = ("prompts", "chunk", "skew")


def matmul_flops(model: DecoderLM, tokens: int, sequences: int) -> int:
    """The step's matmul FLOPs: 2·weights·tokens through the layers' projections, and the LM head
    over one row a sequence (each step's logits are its sequences' last tokens'); attention's
    are not counted."""
    c = model.cfg
    per_layer = sum(p.numel() for n, p in model.layers[0].named_parameters() if "norm" not in n)
    return 2 * (c.layers * per_layer * tokens + c.vocab * c.hidden * sequences)


def timed_steps(setup, step, warmup: int = 2, iters: int = 10) -> float:
    """Median ms of ``step()`` by CUDA events, ``setup()`` (enqueued before the start event) run
    before each."""
    times = []
    for i in range(warmup + iters):
        setup()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def cases(lengths: list[int], mixed: list[int]) -> list[tuple[str, list[int]]]:
    return [(f"b1-{n}", [n]) for n in lengths] + ([(f"mixed{len(mixed)}", mixed)] if mixed else [])


def build_steps(model: DecoderLM, batch: int, max_len: int, page_size: int, buckets: list[int], decode: bool,
                progress: bool) -> TokenBuckets:
    cache = PagedKVCache(model, batch, max_len, page_size)
    steps = TokenBuckets(model, cache, buckets=buckets, decode=decode, options={"executor": "gpu", "sync": False})
    report = steps.compile(progress=progress)
    print(f"  compiled {len(buckets)} bucket(s){' + decode' if decode else ''} for batch {batch}: {report}",
          flush=True)
    return steps


def bench_model(name: str, args, peak: float | None) -> list[dict]:
    cfg = MODELS[name]
    device = "meta" if args.prebuild else "cuda"  # (prebuild: traced on meta tensors, nothing allocated)
    longest = max([*args.lengths, *args.mixed, args.chunk + args.position + 64, args.skew_long + 64])
    model = DecoderLM(cfg, torch.bfloat16, device, max_len=longest + 64)
    if not args.prebuild:
        torch.manual_seed(0)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.normal_(1.0 if "norm" in pname else 0.0, 0.02)
    rows: list[dict] = []
    device_name = torch.cuda.get_device_name() if not args.prebuild else None

    def add(row: dict) -> None:
        row.update(date=datetime.date.today().isoformat(), model=name, page_size=args.page_size, device=device_name,
                   dense_peak_tflops=peak)
        emit_row(row, args.out)
        rows.append(row)

    todo = cases(args.lengths, args.mixed) if "prompts" in args.parts else []
    peers = [{"peer_ms": None, "peer_mode": None, "errors": {}}] * len(todo) if args.skip_peer or args.prebuild else \
        time_peer_prefill(peer_shape(name), [lens for _, lens in todo], compile_mode=args.compile_mode)
    for (case, prompts_len), peer in zip(todo, peers):
        steps = build_steps(model, len(prompts_len), max(prompts_len), args.page_size, [sum(prompts_len)], False,
                            args.progress)
        if args.prebuild:
            continue
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in prompts_len]
        ms = timed_steps(steps.cache.reset, lambda s=steps, p=prompts: s.step(p))
        tokens = sum(prompts_len)
        tflops = matmul_flops(model, tokens, len(prompts_len)) / (ms * 1e-3) / 1e12
        row = {"case": case, "lengths": prompts_len, "tokens": tokens, "mpk_ms": ms,
               "compile_s": steps.report.total_s, "peer_ms": peer["peer_ms"], "peer_mode": peer["peer_mode"],
               "peer_errors": peer["errors"], "speedup": peer["peer_ms"] / ms if peer["peer_ms"] else None,
               "model_tflops": tflops, "peak_fraction": tflops / peak if peak else None}
        if args.profile:
            steps.cache.reset()
            steps.cache.grow(prompts_len)  # the step's table as the timed steps had it; the profiled run re-launches it
            row["breakdown"] = breakdown(steps._compiled[tokens], profile_capacity=1 << 15)
        add(row)
        del steps
        torch._dynamo.reset()  # a graph per case: Dynamo's recompile limit counts every shape traced
        gc.collect()
    # decode alone vs decode with a prefill chunk riding in the same step
    B, chunk = args.decode_batch, args.chunk
    steps = None
    if "chunk" in args.parts:
        steps = build_steps(model, B + 1, args.position + chunk + 64, args.page_size, [B + chunk], True, args.progress)
    if steps is not None and not args.prebuild:
        g = torch.Generator().manual_seed(2)
        cache = steps.cache
        prefix = [torch.randint(0, cfg.vocab, (args.position,), generator=g).tolist() for _ in range(B)]
        prefill(steps, prefix + [[]], chunk=B + chunk)  # the decoding sequences' prompts
        one = [[int(t)] for t in torch.randint(0, cfg.vocab, (B,), generator=g)]
        piece = torch.randint(0, cfg.vocab, (chunk,), generator=g).tolist()
        # the chunk's sequence restarts each step; the decoding ones grow by a token a step
        decode_ms = timed_steps(lambda: cache.reset([B]), lambda s=steps: s.step(one + [[0]]))
        mixed_ms = timed_steps(lambda: cache.reset([B]), lambda s=steps: s.step(one + [piece]))
        add({"case": f"decode{B}+chunk{chunk}", "lengths": [args.position] * B, "tokens": B + chunk,
             "mpk_ms": mixed_ms, "decode_alone_ms": decode_ms, "chunk_cost": mixed_ms / decode_ms,
             "compile_s": steps.report.total_s})
    del steps
    torch._dynamo.reset()
    if "skew" in args.parts:
        skewed_decodes(model, args, add)  # (its rows go through add)
    del model
    torch._dynamo.reset()
    gc.collect()
    if not args.prebuild:
        torch.cuda.empty_cache()
    return rows


def skewed_decodes(model: DecoderLM, args, add) -> None:
    """A decode step of 16 sequences, one of ``--skew-long`` positions and 15 of ``--position``
    (and all 16 of ``--position``, for the cost where nothing is skewed): the decode form, whose
    grid splits each sequence into the same chunks, against the same step as a 16-row ragged
    step, whose attention follows the balanced split made in the launch (attn_plan)."""
    B, n = 16, args.position
    cache = PagedKVCache(model, B, args.skew_long + 64, args.page_size)
    static = TokenBuckets(model, cache, buckets=[B], decode=True, options={"executor": "gpu", "sync": False})
    balanced = TokenBuckets(model, cache, buckets=[B], decode=False, options={"executor": "gpu", "sync": False})
    for s in (static, balanced):
        print(f"  compiled the skewed-decode steps: {s.compile(progress=args.progress)}", flush=True)
    if args.prebuild:
        return
    one = [[1]] * B
    for case, lens in (("skew16", [args.skew_long] + [n] * (B - 1)), ("even16", [n] * B)):
        def setup(lens=lens):
            cache.reset()
            cache.grow([k - 1 for k in lens])  # (the cache's contents do not change the work)
        times = {name: timed_steps(setup, lambda s=s: s.step(one)) for name, s in (("static", static),
                                                                                   ("balanced", balanced))}
        row = {"case": case, "lengths": lens, "tokens": B, "mpk_ms": times["balanced"], "static_ms": times["static"],
               "balanced_gain": times["static"] / times["balanced"]}
        add(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-1.7b", "qwen3-8b"],
                    choices=sorted(MODELS), metavar="MODEL", help=f"any of {', '.join(sorted(MODELS))}")
    ap.add_argument("--lengths", nargs="*", type=count(1), default=[64, 512, 2048, 8192],
                    help="prompt lengths timed at batch 1")
    ap.add_argument("--mixed", nargs="*", type=count(1), default=MIXED,
                    help="prompt lengths prefilled together in one step (none: skip the case)")
    ap.add_argument("--decode-batch", type=count(1), default=15,
                    help="sequences decoding beside the chunk (with the chunk's, 16: the decode fast path's rows)")
    ap.add_argument("--chunk", type=count(1), default=512, help="prefill chunk riding in a decode step")
    ap.add_argument("--position", type=count(1), default=512, help="the decoding sequences' prompt length")
    ap.add_argument("--skew-long", type=count(1), default=16384,
                    help="the long sequence of the skewed decode batch (15 others at --position)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="which cases: the prompts (--lengths, --mixed), decode with a chunk riding, the skewed decodes "
                         "(several --prebuild processes with different parts build in parallel)")
    ap.add_argument("--page-size", type=page_size_arg, default=16, help="KV-cache page size")
    ap.add_argument("--compile-mode", default="default", help="the peer's torch.compile mode")
    ap.add_argument("--skip-peer", action="store_true", help="mpk alone")
    ap.add_argument("--prebuild", action="store_true",
                    help="trace the steps and build their kernels into $MPK_CACHE_DIR (no GPU needed), time nothing")
    ap.add_argument("--progress", action="store_true", help="progress bars while tracing and building")
    ap.add_argument("--profile", action="store_true", help="per-op-kind breakdown of each prompt case's step")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    if not args.prebuild:
        require_cuda("prefill_latency.py", "--prebuild builds its kernels without one")
    peak = None if args.prebuild else dense_peak_tflops()
    if peak:
        print(f"dense bf16 peak (cuBLAS, measured): {peak:.0f} TFLOP/s", flush=True)
    rows = [r for name in args.models for r in bench_model(name, args, peak)]
    if args.prebuild:
        return 0
    print(f"\n{'model':12s} {'case':18s} {'tokens':>6s} {'mpk ms':>8s} {'peer ms':>8s} {'speedup':>8s} "
          f"{'TFLOP/s':>8s} {'of peak':>7s}")
    for r in rows:
        if "static_ms" in r:
            print(f"{r['model']:12s} {r['case']:18s} {r['tokens']:6d} {r['mpk_ms']:8.3f}  decode form (static split) "
                  f"{r['static_ms']:.3f} ms: balanced ×{r['balanced_gain']:.2f}")
            continue
        if "decode_alone_ms" in r:
            print(f"{r['model']:12s} {r['case']:18s} {r['tokens']:6d} {r['mpk_ms']:8.3f}  decode alone "
                  f"{r['decode_alone_ms']:.3f} ms: ×{r['chunk_cost']:.2f}")
            continue
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['model']:12s} {r['case']:18s} {r['tokens']:6d} {r['mpk_ms']:8.3f} "
              f"{r['peer_ms'] or float('nan'):8.3f} {sp:>8s} {r['model_tflops']:8.1f} {r['peak_fraction']:7.2f}")
        if "breakdown" in r:  # one layer's stages (the kinds' summed spans overlap: a stage's tasks wait at gates)
            print("    one layer, µs (span / median task / slowest task): " + " | ".join(
                f"{st['kind']} {st['span']:.0f}/{st['median']:.0f}/{st['max']:.0f}" for st in r["breakdown"]["stages"][:8]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
