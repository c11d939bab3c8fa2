"""Bandwidth of the decode task families alone, inside the persistent kernel.

Each case is a small graph compiled with ``torch.compile(backend="mpk")``; its executor runs
``k`` dependent iterations in one launch, and ``(t(k) − t(1)) / (k − 1)`` is the time of one
iteration (the op's tasks plus one event hop). Reported: bytes the op must read / that time,
and its share of the copy bandwidth measured in the same run. Cases: the linear layers of the
four decode-benchmark model shapes at batch 1 (``--batches``: also others), one graph per
model holding its qkv, o, gate_up, down and LM-head weights (target at batch 1: ≥ 0.85 of copy
bandwidth), paged decode attention over long caches (beside it, ``torch_ms``: PyTorch's SDPA over the
same K/V laid out contiguously, a static cache), and the step's other task families at
qwen3-8b's batch-16 shapes (RMSNorm, qk-norm + RoPE + KV append, SiLU·mul, embedding, argmax,
softmax and topk over the vocabulary, topk over 128 experts' scores): a few hundred KiB to a few MiB each, so their time is mostly
the task's latency and the event hop, which the bandwidth figure then shows; beside those
PyTorch runs as its own kernels, the same op in eager PyTorch (``torch_ms``, timed over
back-to-back calls).

``--prebuild`` (a machine with nvcc and no GPU): trace the cases the other flags select (all,
``--linear-only``, ``--attention-only`` or ``--families-only``) on the CPU and build their kernels into
``$MPK_CACHE_DIR``, for carrying to the device (as prebuild_decode.py).
``--options`` takes one JSON object of mpk compile options per variant of the linear cases
(an A/B in one run: the variants alternate per model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import SHAPES, copy_bandwidth, require_cuda  # noqa: E402

from mpk.backend import COMPILED, RUNNERS, last_args  # noqa: E402
from mpk.cli import count, json_object  # noqa: E402


class Linears(torch.nn.Module):
    """A model's linear layers side by side (independent: one graph, one build per model)."""

    def __init__(self, shapes: list[tuple[int, int]], device: str = "cuda"):
        super().__init__()
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter(0.02 * torch.randn(n, k, device=device, dtype=torch.bfloat16), requires_grad=False)
            for n, k in shapes)

    def forward(self, *xs):
        return tuple(torch.nn.functional.linear(x, w) for x, w in zip(xs, self.ws))


def per_iteration_ms(fn, args, k: int = 21) -> float:
    """Median over 5 of (t(k iterations) − t(1 iteration)) / (k − 1) for one compiled graph."""
    with torch.no_grad():
        fn(*args)
    torch.cuda.synchronize()
    runner = RUNNERS[id(COMPILED[-1])]
    ex, flat = runner.state["ex"], last_args(runner)

    def timed(iters: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ex.launch(flat, iters)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    samples = sorted((timed(k) - timed(1)) / (k - 1) for _ in range(5))
    return samples[2]


def eager_ms(fn, args, k: int = 50) -> float:
    """Median over 5 of the time per call of ``fn`` in eager PyTorch, ``k`` calls back to back."""
    with torch.no_grad():
        fn(*args)
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                fn(*args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / k)
    return sorted(samples)[2]


def family_cases(batch: int = 16, shape: str = "qwen3-8b",
                 device: str = "cuda") -> list[tuple[str, object, tuple, int, bool]]:
    """(label, function, arguments, bytes it must move, whether eager PyTorch runs it as its own
    kernels — not so mpk's fused ops, whose eager form is a reference composite) for the task
    families besides the linears and attention, at ``shape``'s decode sizes."""
    s, bf16 = SHAPES[shape], dict(device=device, dtype=torch.bfloat16)
    d, heads, kvh, hd = s.hidden, s.q_heads, s.kv_heads, s.head_dim
    x, g = torch.randn(batch, d, **bf16), 1 + 0.1 * torch.randn(d, **bf16)
    gate, up = torch.randn(batch, s.inter, **bf16), torch.randn(batch, s.inter, **bf16)
    table, ids = torch.randn(s.vocab, d, **bf16), torch.randint(0, s.vocab, (batch,), device=device)
    logits, logits1 = torch.randn(batch, s.vocab, **bf16), torch.randn(1, s.vocab, **bf16)
    experts = torch.randn(batch, 128, **bf16)
    page, length = 16, 1000  # every sequence appends its token at position 999 of a shuffled page table
    pages = batch * -(-length // page)
    cache = torch.randn(1, 2, pages, kvh, page, hd, **bf16)
    indptr = torch.arange(0, pages + 1, pages // batch, dtype=torch.int32, device=device)
    indices = torch.tensor(random.sample(range(pages), pages), dtype=torch.int32, device=device)
    last = torch.full((batch,), (length - 1) % page + 1, dtype=torch.int32, device=device)
    qkv = torch.randn(batch, (heads + 2 * kvh) * hd, **bf16)
    angles = torch.rand(length, hd // 2, device=device)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).bfloat16()
    qn, kn = 1 + 0.1 * torch.randn(hd, **bf16), 1 + 0.1 * torch.randn(hd, **bf16)
    eps = s.rms_eps

    def norm(x, g):
        return torch.ops.mpk.rms_norm(x, g, eps, torch.float32, torch.bfloat16)

    def silu_mul(gate, up):
        return torch.nn.functional.silu(gate) * up

    def embed(table, ids):
        return torch.nn.functional.embedding(ids, table)

    def greedy(logits):
        return torch.argmax(logits, -1)

    def probs(logits):
        return torch.softmax(logits, -1)

    def top50(logits):  # top-k sampling's candidates
        return torch.topk(logits, 50)

    def route(scores):  # a mixture of experts' routing
        return torch.topk(scores, 8)

    def rope_append(qkv, cos_sin, indptr, indices, last, cache, qn, kn):
        return torch.ops.mpk.rope_append(qkv, cos_sin, indptr, indices, last, cache, qn, kn, 0, heads, kvh, eps)

    return [
        (f"rms_norm B={batch} d={d}", norm, (x, g), 2 * (2 * x.numel() + g.numel()), False),
        (f"silu_mul B={batch} n={s.inter}", silu_mul, (gate, up), 2 * 3 * gate.numel(), True),
        (f"embedding B={batch} d={d}", embed, (table, ids), 2 * 2 * batch * d, True),
        (f"argmax B={batch} vocab={s.vocab}", greedy, (logits,), 2 * logits.numel(), True),
        (f"argmax B=1 vocab={s.vocab}", greedy, (logits1,), 2 * logits1.numel(), True),
        (f"softmax B={batch} vocab={s.vocab}", probs, (logits,), 2 * 2 * logits.numel(), True),
        (f"topk k=50 B={batch} vocab={s.vocab}", top50, (logits,), 2 * logits.numel(), True),
        (f"topk k=50 B=1 vocab={s.vocab}", top50, (logits1,), 2 * logits1.numel(), True),
        (f"topk k=8 B={batch} of 128 experts", route, (experts,), 2 * experts.numel(), True),
        (f"rope_append B={batch} {heads}/{kvh} heads d={hd} (qk-norm)", rope_append,
         (qkv, cos_sin, indptr, indices, last, cache, qn, kn), 2 * batch * ((2 * heads + 4 * kvh) * hd + hd), False),
    ]


# (batch, positions per sequence, q heads, kv heads, head dim): qwen3-8b's heads over 32 K
# positions in all, one long sequence or 16; llama3.2-1b's (d = 64)
ATTENTION_CASES = [(16, 2048, 32, 8, 128), (1, 16384, 32, 8, 128), (16, 2048, 32, 8, 64)]


def attention_case(batch: int, length: int, heads: int, kv_heads: int, dim: int, page: int, device: str):
    """Paged decode attention of ``batch`` sequences of ``length`` positions over a bf16 cache in
    pages of ``page`` positions, dealt in random order: (fn, (q, cache, indptr, indices, last))."""
    pages = batch * length // page
    cache = torch.randn(1, 2, pages, kv_heads, page, dim, device=device, dtype=torch.bfloat16)
    indptr = torch.arange(0, pages + 1, length // page, dtype=torch.int32, device=device)
    indices = torch.randperm(pages, device=device).int()
    last = torch.full((batch,), page, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)

    def attend(q, cache, indptr, indices, last):
        return torch.ops.mpk.paged_attention(q, cache, indptr, indices, last, 0, dim ** -0.5, 0)

    return attend, (q, cache, indptr, indices, last)


def linear_cases(name: str) -> dict[str, tuple[int, int]]:
    s = SHAPES[name]
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q), "gate_up": (2 * s.inter, s.hidden),
            "down": (s.hidden, s.inter), "lm_head": (s.vocab, s.hidden)}


def prebuild(models: list[str], batches: list[int], linears: bool, attention: bool, families: bool,
             variants: list[dict]) -> None:
    """Trace the chosen cases on the CPU — each model's linear case, the paged attention cases,
    the other task families' cases — and build their kernels into the cubin cache."""
    from mpk.errors import ExecutorUnavailableError
    from mpk.executors import build
    from mpk.executors.codegen import generate

    sources = []

    def trace(fn, args, options=None) -> None:
        compiled = torch.compile(fn, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "gpu", **(options or {})})
        COMPILED.clear()
        try:
            with torch.no_grad():
                compiled(*args)
        except ExecutorUnavailableError:
            pass  # compiled, then refused to run without CUDA: the tables are what we came for
        sources.append(generate(COMPILED[-1].tables))
        torch._dynamo.reset()

    for name in models if linears else []:
        shapes = list(linear_cases(name).values())
        for batch in batches:
            for options in variants:
                trace(Linears(shapes, "cpu"), [torch.zeros(batch, k, dtype=torch.bfloat16) for _, k in shapes], options)
    for batch, length, heads, kv_heads, dim in ATTENTION_CASES if attention else []:
        trace(*attention_case(batch, length, heads, kv_heads, dim, 16, "cpu"))
    for _, fn, args, *_ in family_cases(device="cpu") if families else []:
        trace(fn, args)
    print(f"built {len(build.prebuild(sources))} cubins into {build.cache_dir()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"],
                    choices=sorted(SHAPES))
    ap.add_argument("--batches", nargs="+", type=count(1), default=[1], help="rows of the linear cases' activations")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prebuild", action="store_true", help="build the selected cases' kernels (no GPU needed)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--linear-only", action="store_true", help="skip the attention and other task families' cases")
    only.add_argument("--attention-only", action="store_true", help="the paged attention cases alone")
    only.add_argument("--families-only", action="store_true", help="the other task families' cases alone")
    ap.add_argument("--options", nargs="+", type=json_object, default=[{}],
                    help='mpk compile options of the linear cases, one JSON object per variant, e.g. \'{}\' \'{"fuse_norm_prologue": false}\'')
    args = ap.parse_args(argv)
    if args.prebuild:
        prebuild(args.models, args.batches, not (args.attention_only or args.families_only),
                 not (args.linear_only or args.families_only), not (args.linear_only or args.attention_only), args.options)
        return 0
    require_cuda("task_bandwidth.py", "--prebuild builds its kernels without one")
    device, bw = torch.cuda.get_device_name(), copy_bandwidth()
    print(f"device {device}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []

    def record(row):
        row |= {"date": datetime.date.today().isoformat(), "device": device, "copy_GBps": bw / 1e9,
                "nvcc_flags": os.environ.get("MPK_NVCC_FLAGS", "")}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")

    opts = {"executor": "gpu"}
    for name in [] if args.attention_only or args.families_only else args.models:
        shapes = list(linear_cases(name).values())
        model = Linears(shapes)
        for batch in args.batches:
            xs = [torch.randn(batch, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]
            for options in args.options:
                fn = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={**opts, **options})
                ms = per_iteration_ms(fn, xs)
                nbytes = sum(2 * n * k for n, k in shapes)  # the weights (activations and outputs: < 1% at batch 16)
                record({"case": f"linear {name}: {'+'.join(linear_cases(name))}", "batch": batch, "ms": ms,
                        "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / (bw / 1e9)}
                       | ({"options": options} if len(args.options) > 1 else {}))
                torch._dynamo.reset()
    for batch, length, heads, kv_heads, dim in [] if args.linear_only or args.families_only else ATTENTION_CASES:
        page = 16
        attend, (q, cache, indptr, indices, last) = attention_case(batch, length, heads, kv_heads, dim, page, "cuda")
        fn = torch.compile(attend, backend="mpk", fullgraph=True, dynamic=False, options=opts)
        ms = per_iteration_ms(fn, (q, cache, indptr, indices, last))
        # the peer: SDPA over the same K/V laid out contiguously per sequence (a static cache)
        k, v = (cache[0, i, indices.long()].view(batch, length // page, kv_heads, page, dim)
                .permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, length, dim) for i in (0, 1))

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)

        nbytes = cache.numel() * 2
        record({"case": f"paged attention B={batch} len={length} {heads}/{kv_heads} heads d={dim}", "ms": ms,
                "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / (bw / 1e9), "torch_ms": eager_ms(sdpa, (q, k, v))})
        del k, v
        torch._dynamo.reset()
    for label, fn, fargs, nbytes, eager in [] if args.linear_only or args.attention_only else family_cases():
        compiled = torch.compile(fn, backend="mpk", fullgraph=True, dynamic=False, options=opts)
        ms = per_iteration_ms(compiled, fargs)
        record({"case": label, "ms": ms, "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / (bw / 1e9)}
               | ({"torch_ms": eager_ms(fn, fargs)} if eager else {}))
        torch._dynamo.reset()
    print(f"\n{'case':60s} {'ms':>8s} {'GB/s':>7s} {'of copy':>8s} {'torch ms':>9s}")
    for r in rows:
        # the linear cases' rows differ only in batch and options: say which
        case = r["case"] + (f" B={r['batch']}" if "batch" in r else "") + (f" {json.dumps(r['options'])}" if "options" in r else "")
        torch_ms = f"{r['torch_ms']:9.4f}" if "torch_ms" in r else ""
        print(f"{case:60s} {r['ms']:8.4f} {r['GBps']:7.0f} {r['of_copy']:8.2f} {torch_ms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
