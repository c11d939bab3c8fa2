"""Throughput of the tensor-core GEMM task (cuda/mpk_tasks/gemm.cuh) inside the persistent kernel,
against cuBLAS.

Each case is one projection y = x @ Wᵀ (bf16) of a model shape — its qkv, o, gate_up and down
weights — at a prefill of M tokens, compiled alone with ``torch.compile(backend="mpk")``; its
executor runs ``k`` dependent iterations in one launch, and ``(t(k) − t(1)) / (k − 1)`` is one
iteration (the op's tasks plus one event hop). Beside it ``torch.nn.functional.linear`` of the
same operands (cuBLAS), timed over back-to-back calls. Reported: TFLOP/s (2·M·N·K per
projection) of each and their share of the dense bf16 peak measured in the same run as the best
cuBLAS TFLOP/s over large square GEMMs.

``--prebuild`` (a machine with nvcc, with or without a GPU): trace the cases and build their
kernels into ``$MPK_CACHE_DIR``, for carrying to the device (as task_bandwidth.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row  # noqa: E402
from peer import SHAPES, require_cuda  # noqa: E402
from task_bandwidth import eager_ms, per_iteration_ms  # noqa: E402

from mpk.cli import count  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")
PEAK_SIZES = (4096, 8192, 16384)  # square GEMMs whose best cuBLAS rate stands for the dense peak


def projection_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of model shape ``name``: W is N × K, as nn.Linear holds it."""
    s = SHAPES[name]
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q), "gate_up": (2 * s.inter, s.hidden),
            "down": (s.hidden, s.inter)}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def dense_peak_tflops(sizes: tuple[int, ...] = PEAK_SIZES) -> float:
    """The best cuBLAS bf16 TFLOP/s over square GEMMs of ``sizes``."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ms = eager_ms(torch.matmul, (a, b), k=10)
        best = max(best, 2 * n ** 3 / ms / 1e9)
        del a, b
    return best


def prebuild(models: list[str], rows: list[int]) -> None:
    """Trace every case (on meta tensors, nothing runs) and build its kernel into the cubin cache."""
    from mpk.backend import TracedOnly, trace_only
    from mpk.executors import build
    from mpk.executors.codegen import generate

    sources = []
    for name in models:
        for m in rows:
            for n, k in projection_shapes(name).values():
                fn = torch.compile(linear, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "gpu"})
                try:
                    with trace_only():
                        fn(torch.zeros(m, k, dtype=torch.bfloat16, device="meta"),
                           torch.zeros(n, k, dtype=torch.bfloat16, device="meta"))
                except TracedOnly as traced:
                    sources.append(generate(traced.compiled.tables))
                else:
                    raise RuntimeError(f"{name} M={m}: the projection ran instead of being traced (not the mpk backend?)")
                torch._dynamo.reset()
    print(f"built {len(build.prebuild(sources))} cubins into {build.cache_dir()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=count(1), default=[512, 2048, 8192], help="tokens M of the prefill")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines")
    ap.add_argument("--prebuild", action="store_true", help="build the cases' kernels (no GPU needed)")
    args = ap.parse_args(argv)
    if args.prebuild:
        prebuild(args.models, args.rows)
        return 0
    require_cuda("gemm_tflops.py", "--prebuild builds its kernels without one")
    device, peak = torch.cuda.get_device_name(), dense_peak_tflops()
    print(f"device {device}; dense bf16 peak (best cuBLAS over {PEAK_SIZES}) {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.models:
        for m in args.rows:
            for proj, (n, k) in projection_shapes(name).items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                fn = torch.compile(linear, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "gpu"})
                flop = 2 * m * n * k
                ms, torch_ms = per_iteration_ms(fn, (x, w)), eager_ms(linear, (x, w))
                row = {"case": f"{name} {proj}", "M": m, "N": n, "K": k, "ms": ms, "TFLOPs": flop / ms / 1e9,
                       "of_peak": flop / ms / 1e9 / peak, "torch_ms": torch_ms, "torch_TFLOPs": flop / torch_ms / 1e9,
                       "peak_TFLOPs": peak, "date": datetime.date.today().isoformat(), "device": device,
                       "nvcc_flags": os.environ.get("MPK_NVCC_FLAGS", "")}
                rows.append(row)
                emit_row(row, args.out)
                del x, w
                torch._dynamo.reset()
    print(f"\n{'case':22s} {'M':>5s} {'N':>6s} {'K':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'of peak':>8s} "
          f"{'cuBLAS ms':>10s} {'TFLOP/s':>8s} {'of peak':>8s}")
    for r in rows:
        print(f"{r['case']:22s} {r['M']:5d} {r['N']:6d} {r['K']:6d} {r['ms']:8.4f} {r['TFLOPs']:8.1f} "
              f"{r['of_peak']:8.2f} {r['torch_ms']:10.4f} {r['torch_TFLOPs']:8.1f} {r['torch_TFLOPs'] / peak:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
