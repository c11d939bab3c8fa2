"""Prefill and mixed steps of a ``DecoderLM`` on the GPU (marker ``gpu``; skipped without CUDA):
``TokenBuckets`` compiled for the GPU executor against mpk's eager path and a float32 twin."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, TokenBuckets, prefill
from mpk.testing.decode import float32_twin
from mpk.testing.parity import compare_logits

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("family,head_dim,page_size", [("qwen3", 128, 16), ("llama", 64, 1)])
def test_prefill_and_mixed_steps_match_eager(family, head_dim, page_size):
    """bf16: prompts of 1, 17 and 40 tokens prefilled in chunks of 32 (two steps on the 64
    bucket), then two mixed steps (a 20-token chunk beside decodes on the 64 bucket; two
    decodes, one sequence sitting out, on the 8 bucket) and a decode step (the decode graph):
    every new token's logits (logits="all") as close to a float32 twin's as mpk's bf16 eager
    path is (largest and median error relative to the
    largest |logit| within 1.5× the eager path's: different summation orders of bf16 values),
    top-1 agreement ≥ 99% with the eager path where it is decisive. Three kernels, built
    together by compile(); no step compiles another."""
    cfg = LLMConfig(family=family, hidden=512, inter=1024, layers=2, heads=8, kv_heads=2, head_dim=head_dim,
                    vocab=1000, tied=True, eps=1e-6, rope_theta=1e6, max_position=256)
    model = DecoderLM(cfg, torch.bfloat16, DEV, max_len=256).randomize(seed=random.randrange(1 << 30), scale=0.1)
    twin = float32_twin(model)
    runs = [TokenBuckets(model, PagedKVCache(model, 3, 128, page_size), buckets=[8, 64], logits="all",
                         options={"executor": "gpu"}),
            TokenBuckets(model, PagedKVCache(model, 3, 128, page_size), buckets=[8, 64], logits="all", eager=True),
            TokenBuckets(twin, PagedKVCache(twin, 3, 128, page_size), buckets=[8, 64], logits="all", eager=True)]
    report = runs[0].compile()
    graphs = len(COMPILED)
    assert list(report.trace_s) == ["T=8", "T=64", "decode"]

    def tok(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab, (n,)).tolist()

    prompts = [tok(1), tok(17), tok(40)]
    schedule = [[tok(20), tok(1), tok(1)], [tok(1), [], tok(1)], [tok(1), tok(1), tok(1)]]
    outs: list[list[torch.Tensor]] = [[] for _ in runs]
    with torch.no_grad():
        for steps, out in zip(runs, outs):
            out.append(prefill(steps, prompts, 32).float())  # each prompt's last token
            out += [steps.step(row).float() for row in schedule]
    ours, eager, truth = (torch.cat(o) for o in outs)
    assert len(COMPILED) == graphs
    mine, ref = compare_logits(ours, truth), compare_logits(eager, truth)
    assert mine["max_rel"] <= 1.5 * ref["max_rel"] and mine["median_rel"] <= 1.5 * ref["median_rel"], (mine, ref)
    stats = compare_logits(ours, eager)
    assert stats["decisive_share"] == 0 or stats["top1_decisive"] >= 0.99, stats


def _prefill_all_logits(steps: TokenBuckets, tokens: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """[B, S, V] logits of every prompt token: the prompts ``tokens`` [B, S] in one step, or
    sequence after sequence in steps of ``chunk`` tokens (logits="all")."""
    B, S = tokens.shape
    rows = tokens.tolist()
    if chunk is None:
        return steps.step(rows).float().reshape(B, S, -1)
    out = torch.empty(B, S, steps.model.cfg.vocab, device=tokens.device)
    for b in range(B):
        for s0 in range(0, S, chunk):
            new = [rows[b][s0:s0 + chunk] if i == b else [] for i in range(B)]
            out[b, s0:s0 + chunk] = steps.step(new).float()
    return out


@pytest.mark.parametrize("chunk", [None, 64])
def test_bf16_prefill_of_the_full_qwen3_shape_agrees_with_transformers(chunk):
    """The qwen3-1.7b shape (28 layers, random weights shared through safetensors): 4 prompts of
    128 tokens prefilled in one 512-token step or in 64-token chunks, every token's bf16 logits
    against transformers' float32 logits of the same weights, by the decode parity test's
    criteria: top-1 ≥ 99% where the reference is decisive, a median relative error within
    1.25× of transformers' own bf16 run's."""
    from mpk.testing.parity import hf_logits, hf_twin

    cfg = LLMConfig(family="qwen3", hidden=2048, inter=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                    vocab=151936, tied=True, eps=1e-6, rope_theta=1e6, max_position=40960)
    hf, ours = hf_twin(cfg, seed=random.randrange(1 << 30), dtype=torch.bfloat16, device=DEV, max_len=256)
    tokens = torch.randint(0, cfg.vocab, (4, 128), device=DEV)
    hf_bf16, ref = hf_logits(hf, tokens), hf_logits(hf.float(), tokens)
    del hf
    torch.cuda.empty_cache()
    kv = PagedKVCache(ours, 4, 256, 16)
    steps = TokenBuckets(ours, kv, buckets=[chunk or 512], decode=False, logits="all", options={"executor": "gpu"})
    out = _prefill_all_logits(steps, tokens, chunk)
    vs_hf, hf_own = compare_logits(out, ref), compare_logits(hf_bf16, ref)
    print(f"\nqwen3-1.7b prefill (chunk {chunk}): mpk bf16 vs transformers fp32 {vs_hf}; transformers bf16 {hf_own}")
    assert vs_hf["top1_decisive"] >= 0.99 and vs_hf["decisive_share"] >= 0.25, vs_hf
    assert vs_hf["median_rel"] <= 1.25 * hf_own["median_rel"], (vs_hf, hf_own)
