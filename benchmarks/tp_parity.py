"""Tensor-parallel parity on several GPUs: TP N's greedy tokens and logits against TP 1 (the
unsharded megakernel on rank 0's GPU) and against transformers (float32), for models of a
real shape with random weights in bf16.

    torchrun --nproc-per-node 4 benchmarks/tp_parity.py --models qwen3-1.7b qwen3-8b

Rank 0 draws a transformers model (``mpk.testing.parity.hf_model``: init std 0.1, so that
next-token logits are decisive) in float32, copies it into a bf16 ``DecoderLM`` and
broadcasts the weights to the other ranks. The batch's sequences are random tokens: a
``--prompt-len`` prompt and ``--steps`` forced tokens (by default the cache of
``decode_latency.py``'s steps at position 64, so that ``prebuild_decode.py --batches 4`` builds
their kernels). Teacher forced, every position is one
decode step (``mpk.testing.parity.decode_logits``); the last ``--steps`` positions' logits are
compared (``compare_logits``: top-1 agreement over all and over decisive positions, error
relative to the largest |logit|) with transformers' one causal forward and with TP 1's. Free
running, each greedy sequence's agreement with TP 1's and transformers' is the length of the
common prefix. One JSON line per model (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row, max_len  # noqa: E402

from mpk.cli import count, page_size as page_size_arg  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402
from mpk.llm import DecoderLM  # noqa: E402
from mpk.testing.graphs import relative_error  # noqa: E402
from mpk.testing.parity import (compare_logits, copy_hf_weights, decode_logits, greedy_decode, hf_logits,  # noqa: E402
                                hf_model)
from mpk.testing.tp import tp_logits_bound  # noqa: E402


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the length of the longest common prefix of ``a`` and ``b`` [B, S]."""
    same = (a.cpu() == b.cpu()).int().cumprod(1)
    return same.sum(1).double().mean().item()


def hf_greedy(hf, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] transformers' greedy tokens after ``prompt``."""
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def mpk_step(model: DecoderLM, tp: tuple[int, int] | None):
    torch._dynamo.reset()  # a new graph for the new options (Dynamo keeps one per code object)
    options = {"executor": "gpu"} | ({"tensor_parallel": tp} if tp else {})
    return torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options=options)


def run_model(name: str, args, rank: int, world: int) -> dict | None:
    cfg = MODELS[name] if args.layers is None else replace(MODELS[name], layers=args.layers)
    total = args.prompt_len + args.steps
    # decode_latency.py's shapes at position total - 1 (prebuild_decode.py's kernels serve both)
    model = DecoderLM(cfg, torch.bfloat16, "cuda", max_len=max_len(total - 1))
    hf = None
    if rank == 0:
        hf = hf_model(cfg, args.seed, torch.float32, "cuda")
        copy_hf_weights(hf, model)
    if world > 1:
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab, (args.batch, total), generator=g).cuda()
    prompt, forced = tokens[:, :args.prompt_len], slice(args.prompt_len, total)
    row = None
    if rank == 0:
        ref = hf_logits(hf, tokens)[:, forced]
        hf_tokens = hf_greedy(hf, prompt, args.steps)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        step = mpk_step(model, None)
        one = decode_logits(step, model, tokens, args.page_size)[:, forced]
        one_tokens = greedy_decode(step, model, prompt, args.steps, args.page_size)
        del step
    if world > 1:
        dist.barrier()
    step = mpk_step(model, (rank, world))
    many = decode_logits(step, model, tokens, args.page_size)[:, forced]
    many_tokens = greedy_decode(step, model, prompt, args.steps, args.page_size)
    del step
    torch._dynamo.reset()
    if rank == 0:
        rel = max(relative_error(many[:, s], one[:, s]) for s in range(args.steps))
        row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "model": name,
               "layers": cfg.layers, "tp": world, "batch": args.batch, "prompt_len": args.prompt_len,
               "steps": args.steps, "seed": args.seed,
               "vs_hf": compare_logits(many, ref), "tp1_vs_hf": compare_logits(one, ref),
               "vs_tp1": compare_logits(many, one), "max_rel_vs_tp1": rel,
               "rel_bound": tp_logits_bound(cfg, total, world, torch.bfloat16),
               "greedy_prefix_vs_tp1": common_prefix(many_tokens, one_tokens),
               "greedy_prefix_vs_hf": common_prefix(many_tokens, hf_tokens),
               "tp1_greedy_prefix_vs_hf": common_prefix(one_tokens, hf_tokens)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=sorted(MODELS),
                    metavar="MODEL", help=f"any of {', '.join(sorted(MODELS))}")
    ap.add_argument("--layers", type=count(1), default=None, help="cut the models to this many layers")
    ap.add_argument("--batch", type=count(1), default=4, help="sequences per step")
    ap.add_argument("--prompt-len", type=count(1), default=1, help="prompt tokens before the compared ones")
    ap.add_argument("--steps", type=count(1), default=64, help="compared (teacher-forced / greedy) positions")
    ap.add_argument("--page-size", type=page_size_arg, default=16, help="KV-cache page size")
    ap.add_argument("--seed", type=int, default=0, help="weights and tokens")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tp_parity.py needs CUDA GPUs, one per rank", file=sys.stderr)
        return 1
    rank, world, job = 0, 1, None
    if "WORLD_SIZE" in os.environ:
        from mpk.distributed.launch import RankInfo, join
        from mpk.distributed.nvshmem import init_nvshmem

        info = RankInfo.from_env()
        if torch.cuda.device_count() < info.world:
            print(f"tp_parity.py: {info.world} ranks need {info.world} GPUs; {torch.cuda.device_count()} visible",
                  file=sys.stderr)
            return 1
        torch.cuda.set_device(info.local_rank)
        job = join(info, backend="nccl")
        init_nvshmem(job.control)
        rank, world = info.rank, info.world
    rows = []
    try:
        for name in args.models:
            row = run_model(name, args, rank, world)
            if row is not None:
                rows.append(row)
                emit_row(row, args.out)
    finally:
        if job is not None:
            from mpk.distributed.nvshmem import leave

            leave(job)
    if rank == 0:
        print(f"\n{'model':12s} {'tp':>3s} {'top1 hf':>8s} {'decisive':>9s} {'top1 tp1':>9s} {'rel/tp1':>8s} "
              f"{'bound':>8s} {'greedy=tp1':>10s} {'greedy=hf':>9s}")
        for r in rows:
            print(f"{r['model']:12s} {r['tp']:3d} {r['vs_hf']['top1_decisive']:8.4f} {r['vs_hf']['decisive_share']:9.3f} "
                  f"{r['vs_tp1']['top1_decisive']:9.4f} {r['max_rel_vs_tp1']:8.2e} {r['rel_bound']:8.2e} "
                  f"{r['greedy_prefix_vs_tp1']:10.1f} {r['greedy_prefix_vs_hf']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
