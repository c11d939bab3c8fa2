"""``TokenBuckets`` replays a graph's launch without torch.compile's wrappers once it ran
(``DirectStep``): the replayed steps give eager PyTorch's logits, the compiled module is not
called again, and a model whose parameters moved goes back through torch.compile (which
rebinds) and gives the new weights' logits. Tolerance: ``decoder_logits_bound`` (float32, the
positions attended), as tests/models/test_prefill.py."""

from __future__ import annotations

import random

import torch
from torch import nn

from mpk.llm import DecoderLM, PagedKVCache, TokenBuckets
from mpk.testing.decode import small_config
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import decoder_logits_bound

CPU = {"executor": "cpu", "num_workers": 8}
MAX_LEN = 48


def _steps(model: DecoderLM, plan: list[list[list[int]]], eager: bool) -> tuple[list[torch.Tensor], TokenBuckets, list]:
    kv = PagedKVCache(model, batch=2, max_len=MAX_LEN, page_size=16)
    steps = TokenBuckets(model, kv, max_num_batched_tokens=4, options=None if eager else CPU, eager=eager)
    steps.compile()
    calls = []  # calls of the torch.compile'd module from here on
    traced = steps._run
    steps._run = lambda *a, **k: calls.append(1) or traced(*a, **k)
    return [steps.step(tokens) for tokens in plan], steps, calls


def test_replayed_steps_match_eager_and_skip_the_compiled_module():
    cfg = small_config("qwen3", hidden=128, head_dim=64)
    model = DecoderLM(cfg, torch.float32, "cpu", max_len=MAX_LEN).randomize(random.randrange(1 << 30))
    ids = lambda n: [random.randrange(cfg.vocab) for _ in range(n)]  # noqa: E731
    plan = [[ids(3), ids(1)]] + [[ids(1), ids(1)] for _ in range(5)] + [[ids(2), ids(1)]]
    got, steps, calls = _steps(model, plan, eager=False)
    want, _, _ = _steps(model, plan, eager=True)
    bound = decoder_logits_bound(cfg, 16, torch.float32)
    for g, w in zip(got, want):
        assert relative_error(g, w) <= bound
    # one traced call per graph (the ragged bucket of 4 and the decode form), then replays
    assert len(calls) == 2 and set(steps._direct) == {4, "decode"}

    model.lm_head = nn.Parameter(model.lm_head.detach() * 2)  # a new tensor: the replay is stale
    more = [[ids(1), ids(1)]]
    after = steps.step(more[0])
    assert len(calls) == 3  # back through torch.compile
    assert steps._direct["decode"].valid()
    _, eager_steps, _ = _steps(model, plan, eager=True)
    assert relative_error(after, eager_steps.step(more[0])) <= bound
