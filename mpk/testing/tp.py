"""Tensor-parallel test helpers: a tiny ``DecoderLM`` step traced to its OpGraph (nothing
runs), its arguments in the graph's input order, an eager reference, and the logits tolerance
of a sharded step against an unsharded one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpk.backend import TracedOnly, trace_only
from mpk.compiler import CompiledGraph
from mpk.llm.kv_cache import PagedKVCache
from mpk.llm.model import DecoderLM
from mpk.testing.decode import small_config
from mpk.testing.tolerance import decoder_roundings, rounding_bound

STEP_INPUTS = ("tokens", "kv_cache", "kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr")


@dataclass
class TracedStep:
    model: DecoderLM
    compiled: CompiledGraph  # the unsharded graph, compiled for the CPU interpreter
    args: list[torch.Tensor]  # the step's arguments in the graph's input order (the cache: a fresh copy)
    eager: torch.Tensor  # the model's logits, eagerly, from the same cache
    positions: int  # the most cache positions a row attends

    def fresh_args(self) -> list[torch.Tensor]:
        """The arguments with a copy of the cache (steps write it)."""
        return [a.clone() if b.name == "kv_cache" else a for a, b in zip(self.args, self.compiled.graph.inputs)]


def traced_step(family: str, ragged: bool, seed: int, lens: list[int], new: list[int] | None = None,
                num_splits: int = 0, dtype: torch.dtype = torch.float32, **cfg) -> TracedStep:
    """A random tiny Llama / Qwen3 (``dtype``) and one step over sequences of ``lens`` positions,
    the last ``new[b]`` of each new (ragged) or one (decode); the cache holds random earlier k/v.
    ``cfg`` overrides small_config's fields (vocab 96 here: divisible by 2 and 4)."""
    config = small_config(family, **({"vocab": 96} | cfg))
    max_len = 8 * -(-max(lens) // 8)
    model = DecoderLM(config, dtype, max_len=max_len, num_splits=num_splits)
    model.randomize(seed, scale=0.1)
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(model, len(lens), max_len, 8)
    counts = new if ragged else [1] * len(lens)
    cache.grow([n - k for n, k in zip(lens, counts)])
    cache.cache.copy_(torch.randn(cache.cache.shape, generator=g).to(dtype))
    cache.grow(counts)
    rows = sum(counts) + (2 if ragged else 0)  # a ragged step: two padding rows
    tokens = torch.randint(0, config.vocab, (rows,), generator=g)
    inputs = dict(zip(STEP_INPUTS, (tokens, *cache.args(), cache.qo_indptr if ragged else None)))
    call = [inputs[k] for k in STEP_INPUTS[:5]] + ([inputs["qo_indptr"]] if ragged else [])
    # each traced step is a new model (new shapes): without a reset, a session tracing many of
    # them (the whole suite) would reach Dynamo's recompile limit for DecoderLM.forward and run it eagerly
    torch._dynamo.reset()
    step = torch.compile(model, backend="mpk", options={"executor": "cpu", "num_workers": 8,
                                                        "fuse_norm_stats": False}, fullgraph=True)
    with torch.no_grad(), trace_only():
        try:
            step(*call)
            raise AssertionError("trace_only() ran the step")
        except TracedOnly as e:
            compiled = e.compiled
    with torch.no_grad():
        eager = model(*[a.clone() if i == 1 else a for i, a in enumerate(call)])
    named = dict(model.named_parameters()) | dict(model.named_buffers()) | inputs
    args = [named[b.name].clone() if b.name == "kv_cache" else named[b.name] for b in compiled.graph.inputs]
    return TracedStep(model, compiled, args, eager, max(lens))


def tp_logits_bound(cfg, positions: int, world: int, dtype: torch.dtype = torch.float32) -> float:
    """``relative_error`` bound between a sharded step's logits and an unsharded one's: each
    within ``rounding_bound`` of the exact logits (mpk.testing.tolerance.decoder_roundings),
    the sharded one with two more roundings a layer (each row-parallel partial rounded to the
    dtype before its reduce) and a world-term float32 sum per reduce (two a layer, one for the
    embedding)."""
    gains, k = decoder_roundings(cfg, positions)
    sharded = rounding_bound(dtype, [gains + 2 * cfg.layers], k + world * (2 * cfg.layers + 1))
    return sharded + rounding_bound(dtype, [gains], k)
