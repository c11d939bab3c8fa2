"""RankBinder: a rank's arguments made from the caller's full ones once and reused while the
sources stay the same tensors, re-made when a weight changes in place or another tensor is
passed; the KV cache's shard keeps one address and is written back after every launch."""

import torch

from mpk.distributed.binding import RankBinder
from mpk.distributed.shard import shard_graph
from mpk.distributed.symmetric import CpuSymmetricHeap
from mpk.testing.tp import traced_step


def _setup():
    step = traced_step("llama", False, int(torch.randint(0, 1 << 20, ())), lens=[3, 6])
    sharded = shard_graph(step.compiled.graph, 1, 2)
    binder = RankBinder(sharded, CpuSymmetricHeap(2).allocator(1))
    names = {b.name: b.input_index for b in step.compiled.graph.inputs}
    where = {s.source: i for i, s in enumerate(sharded.inputs) if s.kind in ("slice", "full")}
    return step, sharded, binder, names, where


def test_arguments_are_reused_while_the_sources_stay_the_same():
    step, sharded, binder, names, where = _setup()
    full = step.fresh_args()
    first, back = binder.bind(full)
    RankBinder.write_back(back)
    again, _ = binder.bind(full)
    assert all(a is b for a, b in zip(first, again))
    tokens = full[names["tokens"]].clone()  # a new step input: passed through, nothing else re-made
    full[names["tokens"]] = tokens
    third, _ = binder.bind(full)
    assert third[where[names["tokens"]]] is tokens
    assert sum(a is not b for a, b in zip(first, third)) == 1


def test_a_weight_changed_in_place_is_sliced_again():
    step, sharded, binder, names, where = _setup()
    full = step.fresh_args()
    i = where[names["layers.0.qkv"]]
    before = binder.bind(full)[0][i].clone()
    with torch.no_grad():
        full[names["layers.0.qkv"]].mul_(2)  # in place: the version counter moves
    after = binder.bind(full)[0][i]
    assert torch.equal(after, 2 * before)
    assert torch.equal(after, sharded.inputs[i].take(full[names["layers.0.qkv"]]))


def test_the_cache_shard_keeps_its_address_and_is_written_back():
    step, sharded, binder, names, where = _setup()
    full = step.fresh_args()
    i, spec = where[names["kv_cache"]], sharded.inputs[where[names["kv_cache"]]]
    args, back = binder.bind(full)
    shard = args[i]
    shard.normal_()  # what a launch writes
    RankBinder.write_back(back)
    assert torch.equal(spec.take(full[names["kv_cache"]]), shard)
    fresh = torch.randn_like(full[names["kv_cache"]])  # another cache: read into the same shard tensor
    full[names["kv_cache"]] = fresh
    args, _ = binder.bind(full)
    assert args[i] is shard and shard.data_ptr() == args[i].data_ptr()
    assert torch.equal(shard, spec.take(fresh))


def test_a_rank_local_cache_is_bound_live_and_holds_only_its_heads():
    """A cache from ``new_cache(..., tensor_parallel)``: the rank's kv heads are a contiguous
    slice of the full-shaped tensor, its memory about a share of the whole, and the binder
    hands the launch that slice itself (no shard copy, nothing to write back)."""
    step, sharded, binder, names, where = _setup()
    i, spec = where[names["kv_cache"]], sharded.inputs[where[names["kv_cache"]]]
    full = step.fresh_args()
    whole = full[names["kv_cache"]]
    local = step.model.new_cache(whole.shape[2], whole.shape[4], tensor_parallel=(1, 2))
    (lo, hi), = spec.ranges
    assert local.shape == whole.shape and (lo, hi) == (1, 2)
    share = whole.numel() * (hi - lo) // whole.shape[3]
    assert share <= local.untyped_storage().nbytes() // local.element_size() <= share + whole[0, 0, 0].numel()
    mine = local.narrow(3, lo, hi - lo)
    mine.copy_(whole.narrow(3, lo, hi - lo))
    full[names["kv_cache"]] = local
    args, back = binder.bind(full)
    assert back == [] and args[i].data_ptr() == mine.data_ptr() and args[i].is_contiguous()
    args[i].normal_()  # what a launch writes lands in the caller's cache
    assert torch.equal(mine, args[i]) and not torch.equal(mine, whole.narrow(3, lo, hi - lo))
    again, _ = binder.bind(full)
    assert again[i] is args[i]


def test_rank_local_refuses_a_slice_outside_the_shape():
    import pytest

    from mpk.distributed.binding import rank_local

    with pytest.raises(ValueError, match=r"slice \[2, 5\) of dim 1"):
        rank_local((3, 4, 5), 1, 2, 5, torch.float32, "cpu")
    t = rank_local((3, 4, 5), 1, 2, 4, torch.float32, "cpu")
    assert t.narrow(1, 2, 2).is_contiguous() and not t.is_contiguous()
