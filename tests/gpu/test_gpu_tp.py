"""Tensor parallelism at degree 1 on one GPU (marker ``gpu``): the sharded graph keeps its
collective tasks (comm_put, all_reduce, all_gather over a LocalAllocator's buffers), runs in
the persistent kernel and matches eager PyTorch; several launches reuse the buffers (sequence
numbers and parity slots carry over)."""

from __future__ import annotations

import pytest
import torch

from mpk.backend import COMPILED
from mpk.llm import DecoderLM, PagedKVCache
from mpk.testing.decode import small_config
from mpk.testing.graphs import relative_error
from mpk.testing.tp import tp_logits_bound

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_degree_one_decode_matches_eager(family):
    cfg = small_config(family, vocab=256, head_dim=64, hidden=256, inter=512)
    model = DecoderLM(cfg, torch.bfloat16, device="cuda", max_len=64).randomize(int(torch.randint(0, 1 << 20, ())),
                                                                                  scale=0.05)
    cache = PagedKVCache(model, 2, 64, 16)
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu", "tensor_parallel": (0, 1)})
    eager_cache = cache.cache.clone()
    with torch.no_grad():
        for k in range(3):  # three launches over the same communication buffers
            cache.grow(1)
            tokens = torch.randint(0, cfg.vocab, (2,), device="cuda")
            out = step(tokens, *cache.args())
            ref = model(tokens, eager_cache, *cache.args()[1:])
            assert relative_error(out, ref) <= tp_logits_bound(cfg, cache.lens[0], 1, torch.bfloat16), k
    kinds = [op.kind for op in COMPILED[-1].graph.ops]
    assert {"comm_put", "all_reduce", "all_gather"} <= set(kinds)
