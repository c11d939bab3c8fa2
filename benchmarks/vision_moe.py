"""Vision and MoE inference latency: mpk's megakernel against torch.compile + CUDA graph, in one
run on one device.

Models (transformers, random bf16 weights, eval mode): ResNet-50 (``ResNetForImageClassification``
with ``ResNetConfig``'s defaults: bottleneck blocks [3, 4, 6, 3], widths 256…2048, 1000 classes)
and ViT-B/16 (``ViTForImageClassification`` with ``ViTConfig``'s defaults: 12 layers, hidden 768,
12 heads, MLP 3072, 16×16 patches of 224×224 images, 1000 classes) at ``--batches`` images, and
one Mixtral-8x7B-shaped sparse MoE layer (``MixtralSparseMoeBlock``: hidden 4096, FFN 14336, 8
experts, top-2) at ``--tokens`` tokens.

mpk: ``torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor":
"gpu", "sync": False})`` — the whole forward in one persistent-kernel launch; the MoE block with
``config._experts_implementation = "batched_mm"`` (transformers' default experts loop finds the
experts hit with ``nonzero``, which Dynamo cannot trace whole; mpk runs the gathered-weight bmm as
its ``expert_matmul`` without gathering). The peer, timed in the same run on the same weights
and inputs: eager, and ``torch.compile(model, mode=--compile-mode)`` captured in a
``torch.cuda.CUDAGraph`` and replayed; its MoE block uses ``--peer-experts`` (default
``grouped_mm``: ``torch._grouped_mm`` over the tokens sorted by expert, which CUDA graphs can
capture; ``batched_mm`` would materialise a weight copy per token). Times: the median of CUDA-
event-timed calls after warm-up, back to back. ``rel_diff``: max |mpk − peer| / max |peer| of
the outputs (both bf16; a sanity check, not a precision claim).

``--prebuild`` traces every case on the CPU and builds its kernel into ``$MPK_CACHE_DIR``
without a GPU (weights uninitialised: the tables do not depend on them), as
``prebuild_decode.py`` does. ``--smoke`` compiles tiny versions of the three models on the CPU
executor and checks them against eager float32 (no GPU, no timing). Prints one JSON line per
case (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row  # noqa: E402
from peer import _capture, require_cuda, time_step  # noqa: E402

from mpk.backend import TracedOnly, trace_only  # noqa: E402
from mpk.cli import count  # noqa: E402

MOE = {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}
TINY_MOE = {"hidden_size": 32, "intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2}
TINY_VISION = {"image_size": 32, "num_labels": 10}


def resnet50(tiny: bool = False) -> torch.nn.Module:
    import transformers

    cfg = transformers.ResNetConfig(num_labels=1000)  # the defaults are ResNet-50's
    if tiny:
        cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                        num_labels=TINY_VISION["num_labels"])
    return transformers.ResNetForImageClassification(cfg)


def vit_b16(tiny: bool = False) -> torch.nn.Module:
    import transformers

    cfg = transformers.ViTConfig(num_labels=1000)  # the defaults are ViT-B/16's at 224×224
    if tiny:
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     patch_size=8, **TINY_VISION)
    return transformers.ViTForImageClassification(cfg)


def mixtral_moe(experts_implementation: str = "batched_mm", tiny: bool = False) -> torch.nn.Module:
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(**(TINY_MOE if tiny else MOE))
    cfg._experts_implementation = experts_implementation
    return MixtralSparseMoeBlock(cfg)


def image_size(model: torch.nn.Module) -> int:
    return getattr(model.config, "image_size", 224)


def cases(args) -> list[tuple[str, Callable[[], torch.nn.Module], Callable[[torch.device], torch.Tensor], int]]:
    """(model, builder, input maker, batch or tokens) per case; a builder runs under the target
    device and dtype defaults."""
    out = []
    for name, build in (("resnet50", lambda: resnet50(args.smoke)), ("vit-b16", lambda: vit_b16(args.smoke))):
        if name in args.models:
            for b in args.batches:
                out.append((name, build, lambda dev, m, b=b: torch.randn(b, 3, image_size(m), image_size(m),
                                                                          device=dev), b))
    if "mixtral-moe" in args.models:
        for t in args.tokens:
            out.append(("mixtral-moe", lambda: mixtral_moe("batched_mm", args.smoke),
                        lambda dev, m, t=t: torch.randn(1, t, m.experts.config.hidden_size, device=dev), t))
    return out


def logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights: N(0, 0.02) for matrices and convolutions, 1 / 0 for norms' scales / shifts
    (batch norms keep their fresh statistics, mean 0 and variance 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or "experts" in name:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)


def mpk_compiled(model: torch.nn.Module, executor: str) -> Callable:
    options = {"executor": executor, "sync": False} if executor == "gpu" else {"executor": executor,
                                                                                 "num_workers": 8}
    return torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options=options)


def peer_model(model: torch.nn.Module, args) -> torch.nn.Module:
    """The peer's module on the same weights: the MoE block re-made with ``--peer-experts``
    (its experts read the implementation from their config at each call), sharing the tensors."""
    if not hasattr(model, "experts"):
        return model
    with torch.device("meta"):
        peer = mixtral_moe(args.peer_experts, args.smoke)
    peer.load_state_dict(model.state_dict(), assign=True)
    return peer.eval()


def prebuild_case(name: str, build, make_input, n: int) -> str:
    """The generated CUDA of the case's mpk kernel, traced on the CPU (uninitialised weights)."""
    from mpk.executors.codegen import generate

    with torch.device("cpu"):
        model = build().to(torch.bfloat16).eval()
    x = make_input("cpu", model).to(torch.bfloat16)
    try:
        with torch.no_grad(), trace_only():
            mpk_compiled(model, "gpu")(x)
    except TracedOnly as e:
        return generate(e.compiled.tables)
    finally:
        torch._dynamo.reset()
    raise RuntimeError(f"{name} {n}: nothing was compiled")


def smoke_case(name: str, build, make_input, n: int) -> dict:
    """The tiny model compiled on the CPU executor in float32 against eager."""
    from mpk.testing.graphs import relative_error

    model = build().eval()
    init_weights(model)
    x = make_input("cpu", model)
    start = time.perf_counter()
    with torch.no_grad():
        out = logits(mpk_compiled(model, "cpu")(x))
        ref = logits(model(x))
    torch._dynamo.reset()
    return {"case": f"{name}-{n}", "model": name, "n": n, "compile_s": time.perf_counter() - start,
            "rel_diff": relative_error(out, ref), "smoke": True}


def bench_case(name: str, build, make_input, n: int, args, device_name: str) -> dict:
    with torch.device("cuda"):
        model = build().to(torch.bfloat16).eval()
    init_weights(model)
    x = make_input("cuda", model).to(torch.bfloat16)
    row: dict = {"case": f"{name}-{n}", "model": name, "n": n, "errors": {}}
    with torch.no_grad():
        start = time.perf_counter()
        mpk = mpk_compiled(model, "gpu")
        out = logits(mpk(x)).clone()
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - start
        row["mpk_ms"] = time_step(lambda: mpk(x), args.warmup, args.iters)
        torch._dynamo.reset()
        peer = peer_model(model, args)
        times: dict[str, float | None] = dict.fromkeys(("eager", "compile_graph"))
        ref = None
        if not args.skip_peer:
            try:
                ref = logits(peer(x)).clone()
                times["eager"] = time_step(lambda: peer(x), args.warmup, args.iters)
                compiled = torch.compile(peer, mode=args.compile_mode, dynamic=False)
                graph, _ = _capture(lambda: logits(compiled(x)))
                times["compile_graph"] = time_step(graph.replay, args.warmup, args.iters)
            except Exception as e:  # noqa: BLE001 - the row records the peer's failure
                row["errors"]["peer"] = f"{type(e).__name__}: {e}"[:800]
    row.update({f"peer_{k}_ms": v for k, v in times.items()})
    peer_ms = times["compile_graph"]
    row.update(peer_ms=peer_ms, speedup=peer_ms / row["mpk_ms"] if peer_ms else None,
               rel_diff=float((out.double() - ref.double()).abs().max() / ref.double().abs().max()) if ref is not None
               else None, date=datetime.date.today().isoformat(), device=device_name, dtype="bfloat16",
               compile_mode=args.compile_mode, peer_experts=args.peer_experts if name == "mixtral-moe" else None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50", "vit-b16", "mixtral-moe"],
                    choices=["resnet50", "vit-b16", "mixtral-moe"])
    ap.add_argument("--batches", nargs="+", type=count(1), default=[1, 32], help="images per call (vision models)")
    ap.add_argument("--tokens", nargs="+", type=count(1), default=[1, 4, 16, 64], help="tokens per call (MoE layer)")
    ap.add_argument("--compile-mode", default="default",
                    help="the peer's torch.compile mode, e.g. max-autotune-no-cudagraphs (slow to compile for "
                         "ResNet-50's convolutions); its CUDA graph is captured here")
    ap.add_argument("--peer-experts", default="grouped_mm", help="the peer MoE block's experts implementation")
    ap.add_argument("--warmup", type=count(1), default=5)
    ap.add_argument("--iters", type=count(20), default=30)
    ap.add_argument("--skip-peer", action="store_true", help="mpk alone")
    ap.add_argument("--prebuild", action="store_true",
                    help="trace the cases and build their kernels into $MPK_CACHE_DIR (no GPU needed), time nothing")
    ap.add_argument("--jobs", type=count(1), default=None, help="--prebuild's parallel nvcc processes")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny models on the CPU executor against eager float32 (no GPU), time nothing")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    todo = cases(args)
    if args.smoke:
        bad = 0
        for case in todo:
            row = smoke_case(*case)
            emit_row(row, args.out)
            bad += row["rel_diff"] > 1e-5
        return int(bad > 0)
    if args.prebuild:
        from mpk.executors import build

        sources = []
        for case in todo:
            sources.append(prebuild_case(*case))
            print(f"traced {case[0]} {case[3]}", flush=True)
        start = time.perf_counter()
        paths = build.prebuild(sources, jobs=args.jobs)
        print(f"built {len(paths)} cubins in {time.perf_counter() - start:.0f} s into {build.cache_dir()}", flush=True)
        return 0
    require_cuda("vision_moe.py", "--prebuild builds its kernels and --smoke checks tiny models without one")
    device_name = torch.cuda.get_device_name()
    rows = []
    for case in todo:
        row = bench_case(*case, args, device_name)
        emit_row(row, args.out)
        rows.append(row)
        torch._dynamo.reset()  # frees the case's models (Dynamo's caches hold them) before the next
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'model':12s} {'n':>4s} {'mpk ms':>8s} {'peer ms':>8s} {'eager ms':>8s} {'speedup':>8s} {'rel diff':>9s}")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        rd = f"{r['rel_diff']:.2e}" if r["rel_diff"] is not None else "-"
        print(f"{r['model']:12s} {r['n']:4d} {r['mpk_ms']:8.3f} {r['peer_ms'] or float('nan'):8.3f} "
              f"{r['peer_eager_ms'] or float('nan'):8.3f} {sp:>8s} {rd:>9s}" +
              (f"  peer failed: {r['errors']['peer'][:60]}" if r["errors"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
