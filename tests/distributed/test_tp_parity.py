"""TP 2 and 4 logits equal TP 1's, the unsharded graph's and eager PyTorch's, within the
float32 bound derived from the step's roundings and reduction lengths (mpk.testing.tp), for a
Llama and a Qwen3 config, a decode step and a ragged step; every rank gets the same bits."""

from functools import lru_cache

import pytest
import torch

from mpk.distributed.ranks import build_ranks, run_ranks
from mpk.distributed.shard import kv_head_range
from mpk.executors import Interpreter
from mpk.testing.graphs import relative_error
from mpk.testing.tp import tp_logits_bound, traced_step


@lru_cache(maxsize=None)
def _step(family: str, ragged: bool):
    seed = int(torch.randint(0, 1 << 20, ()))
    # Llama: kv_heads 2, so TP 4 replicates each kv head on two ranks; Qwen3 (qk-norm) with 4
    # kv heads splits them at TP 4 too
    cfg = {} if family == "llama" else {"kv_heads": 4}
    step = traced_step(family, ragged, seed, lens=[13, 6, 9], new=[5, 1, 3] if ragged else None, **cfg)
    unsharded = Interpreter(step.compiled.tables).run(step.fresh_args())
    return step, unsharded


@pytest.mark.parametrize("ragged", [False, True], ids=["decode", "ragged"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp_logits_match_unsharded(family, ragged):
    step, (ref_cache, ref) = _step(family, ragged)
    cfg = step.model.cfg
    assert relative_error(ref, step.eager) <= tp_logits_bound(cfg, step.positions, 1)
    by_world = {}
    for world in (1, 2, 4):
        args = step.fresh_args()
        outs = run_ranks(build_ranks(step.compiled.graph, world), args, seed=world)
        logits = [o[-1] for o in outs]
        for r in range(1, world):
            assert torch.equal(logits[r], logits[0]), f"rank {r} of {world} differs from rank 0"
        bound = tp_logits_bound(cfg, step.positions, world)
        assert relative_error(logits[0], ref) <= bound, (world, relative_error(logits[0], ref), bound)
        assert relative_error(logits[0], step.eager) <= bound
        # the ranks' KV heads, written back into the full cache: the unsharded step's appends
        cache = args[[b.name for b in step.compiled.graph.inputs].index("kv_cache")]
        assert relative_error(cache, ref_cache) <= bound
        by_world[world] = logits[0]
    assert relative_error(by_world[2], by_world[1]) <= tp_logits_bound(cfg, step.positions, 2)
    assert relative_error(by_world[4], by_world[1]) <= tp_logits_bound(cfg, step.positions, 4)


def test_tp_attention_with_chunks_and_merge():
    """A prefix long enough for several KV chunks a row (attn_plan, attn_merge per rank)."""
    step = traced_step("qwen3", True, int(torch.randint(0, 1 << 20, ())), lens=[136, 12], new=[4, 3], num_splits=4)
    assert "attn_merge" in [op.kind for op in step.compiled.graph.ops]
    ref = Interpreter(step.compiled.tables).run(step.fresh_args())[-1]
    outs = run_ranks(build_ranks(step.compiled.graph, 2), step.fresh_args(), seed=7)
    assert torch.equal(outs[0][-1], outs[1][-1])
    assert relative_error(outs[0][-1], ref) <= tp_logits_bound(step.model.cfg, step.positions, 2)


def test_tp_iterations_and_launches_reuse_the_buffers():
    """Two launches of two iterations each over the same communication buffers: the sequence
    numbers and parity slots carry over, and every iteration gives the first one's logits (a
    decode step rewrites the same cache slot with the same values)."""
    step, (_, ref) = _step("llama", False)
    ranks = build_ranks(step.compiled.graph, 2)
    args = step.fresh_args()
    for launch in range(2):
        outs = run_ranks(ranks, args, seed=launch, iterations=2)
        assert relative_error(outs[0][-1], ref) <= tp_logits_bound(step.model.cfg, step.positions, 2)
    seq = ranks[0].binder._made  # the counters the tiles advanced
    counters = [t for _, t in seq.values() if t.dtype == torch.int64 and t.dim() == 2 and t.shape[0] == 3]
    assert counters and all(bool((c == 4).all()) for c in counters), "4 iterations: every tile sent and consumed 4 times"


def test_many_uneven_collective_tiles():
    """16 column tiles of uneven widths per collective (the LM head's 48 columns of a rank: 3
    each; hidden 64: 4 each), as wide collectives get by default (default_comm_tiles)."""
    from mpk.distributed.shard import default_comm_tiles

    assert [default_comm_tiles(n) for n in (8, 64, 2048, 4096, 37984)] == [1, 4, 8, 8, 64]
    step, (_, ref) = _step("qwen3", False)
    outs = run_ranks(build_ranks(step.compiled.graph, 2, comm_tiles=16), step.fresh_args(), seed=3)
    assert torch.equal(outs[0][-1], outs[1][-1])
    assert relative_error(outs[0][-1], ref) <= tp_logits_bound(step.model.cfg, step.positions, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_local_caches_give_the_full_caches_bits(world):
    """Each rank over its own rank-local cache (DecoderLM.new_cache(..., tensor_parallel)),
    holding its kv heads of the same values: the same logits, bit for bit, as the ranks over
    the full cache, and each rank's heads hold the full cache's appends."""
    step, _ = _step("qwen3", True)
    at = [b.name for b in step.compiled.graph.inputs].index("kv_cache")
    args = step.fresh_args()
    full = run_ranks(build_ranks(step.compiled.graph, world), args, seed=world)
    start, per_rank, mine = step.fresh_args()[at], [], []
    for r in range(world):
        local = step.model.new_cache(start.shape[2], start.shape[4], tensor_parallel=(r, world))
        lo, hi = kv_head_range(start.shape[3], r, world)
        local.narrow(3, lo, hi - lo).copy_(start.narrow(3, lo, hi - lo))
        per_rank.append([local if i == at else a for i, a in enumerate(step.fresh_args())])
        mine.append((local, lo, hi))
    outs = run_ranks(build_ranks(step.compiled.graph, world), per_rank, seed=world)
    for r in range(world):
        assert torch.equal(outs[r][-1], full[r][-1]), f"rank {r} of {world}"
        local, lo, hi = mine[r]
        assert torch.equal(local.narrow(3, lo, hi - lo), args[at].narrow(3, lo, hi - lo))
