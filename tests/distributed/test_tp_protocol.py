"""The cross-rank protocol fails loudly in the multi-rank interpreter: a dropped signal is a
deadlock naming the waiting tasks and signal, a collective without parity double-buffering a
race; and the sharding pass refuses what it cannot split."""

import pytest
import torch
import torch.nn.functional as F

from mpk.distributed import symmetric
from mpk.distributed.ranks import build_ranks, run_ranks
from mpk.distributed.shard import shard_graph
from mpk.errors import DeadlockError, OptionError, RaceError, ShardingError
from mpk.ops import collective
from mpk.options import CompileOptions
from mpk.testing.graphs import trace_graph
from mpk.testing.tp import traced_step


def _embedding_graph(vocab: int = 64, hidden: int = 32, rows: int = 6):
    """tokens → embedding: one vocabulary-parallel all_reduce and nothing after it, the graph
    where only the parity slots keep a fast rank off a slow rank's unread data."""
    w, ids = torch.randn(vocab, hidden), torch.randint(0, vocab, (rows,))
    return trace_graph(lambda w, ids: F.embedding(ids, w), (w, ids)), [w, ids]


def test_dropped_signal_is_a_deadlock(monkeypatch):
    graph, args = _embedding_graph()
    ranks = build_ranks(graph, 2, comm_tiles=2)
    real = symmetric.signal

    def drop_rank1_tile1(handle, index, seq):
        if index != (1, 1):
            real(handle, index, seq)

    monkeypatch.setattr(symmetric, "signal", drop_rank1_tile1)
    with pytest.raises(DeadlockError) as e:
        run_ranks(ranks, args, seed=0)
    msg = str(e.value)
    assert "rank 0" in msg and "signal [rank 1, tile 1] = 0, needs ≥ 1" in msg and "all_reduce" in msg


def test_without_parity_slots_a_fast_rank_races(monkeypatch):
    graph, args = _embedding_graph()
    ref = F.embedding(args[1], args[0])
    for seed in range(10):  # the double-buffered protocol: no race in any of these schedules
        for out in run_ranks(build_ranks(graph, 2, comm_tiles=2), args, seed=seed, iterations=3):
            assert torch.equal(out[0], ref)
    monkeypatch.setattr(collective, "slot_of", lambda seq: 0)
    caught = []
    for seed in range(10):
        try:
            run_ranks(build_ranks(graph, 2, comm_tiles=2), args, seed=seed, iterations=3)
        except RaceError as e:
            caught.append(str(e))
    assert caught, "one receive slot: some schedule must let a rank overwrite data its peer has not reduced"
    assert "has not reduced yet" in caught[0] or "overwritten" in caught[0]


@pytest.mark.parametrize("field, value, world, named", [
    ("heads", 6, 4, "the number of attention heads is 6"),
    ("inter", 90, 4, "the intermediate size is 90"),
    ("vocab", 97, 2, "the vocabulary is 97"),
    ("kv_heads", 3, 2, "kv_heads is 3"),
])
def test_sizes_not_divisible_by_the_degree(field, value, world, named):
    cfg = {field: value} | ({"heads": 6, "kv_heads": 3} if field == "kv_heads" else {})
    step = traced_step("qwen3", False, 0, lens=[3], **cfg)
    with pytest.raises(ShardingError, match=named + f".*degree {world}"):
        shard_graph(step.compiled.graph, 0, world)


def test_unclassified_projection():
    graph = trace_graph(lambda x, w: F.linear(x, w), (torch.randn(2, 8), torch.randn(4, 8)))
    with pytest.raises(ShardingError, match="cannot classify projection"):
        shard_graph(graph, 0, 2)


@pytest.mark.parametrize("tp", [(2, 2), (0, 0), (-1, 2), (0.0, 1), (True, 2), "0,2", (0, 1, 2)])
def test_tensor_parallel_option_is_checked(tp):
    with pytest.raises(OptionError, match="tensor_parallel="):
        CompileOptions.parse({"executor": "cpu", "tensor_parallel": tp})


def test_tensor_parallel_option():
    opts = CompileOptions.parse({"executor": "cpu", "tensor_parallel": [1, 4]})
    assert opts.tensor_parallel == (1, 4) and "norm_stats" not in opts.optional_fusions()


def test_input_specs_say_where_each_input_comes_from():
    from mpk.distributed.shard import describe_inputs

    step = traced_step("llama", False, 0, lens=[3])  # tied embedding, kv_heads 2, vocab 96
    sharded = shard_graph(step.compiled.graph, 1, 2)
    specs = {d["name"]: d for d in describe_inputs(sharded)}
    full = {b.name: b.input_index for b in step.compiled.graph.inputs}
    assert specs["kv_cache"]["kind"] == "slice"
    assert specs["kv_cache"]["dim"] == 3 and specs["kv_cache"]["ranges"] == ((1, 2),) and specs["kv_cache"]["state"]
    assert specs["embed"]["ranges"] == ((48, 96),) and specs["embed"]["source"] == full["embed"]  # both its uses
    hd, q, kv = 16, 64, 32
    assert specs["layers.0.qkv"]["ranges"] == ((32, 64), (q + hd, q + 2 * hd), (q + kv + hd, q + kv + 2 * hd))
    assert specs["layers.0.gate_up"]["ranges"] == ((48, 96), (96 + 48, 192))
    assert specs["layers.1.o"]["dim"] == 1 and specs["layers.1.o"]["ranges"] == ((32, 64),)
    assert specs["tokens"]["kind"] == "full"
    comm = [d for d in specs.values() if d["kind"] in ("symmetric", "peers", "local")]
    assert len(comm) == 5 * (2 + 2 * 2)  # recv, signals, two peer tables, seq per collective
    for d in comm:
        if d["kind"] == "peers":
            assert sharded.inputs[d["of"]].kind == "symmetric"


def test_puts_wait_for_exactly_the_matmul_tiles_they_send():
    """A put of columns [a, b) depends on the producer tiles that write them and nothing else,
    so early tiles' transfers start while later tiles compute; its reduce on its put."""
    from mpk.compiler import compile_graph
    from mpk.ops.collective import tile_bounds

    step = traced_step("llama", False, 0, lens=[3, 5])
    sharded = shard_graph(step.compiled.graph, 0, 2, comm_tiles=4)
    tg = compile_graph(sharded.graph, 8, partition={"matmul": [1, 8]}).taskgraph
    ops = sharded.graph.ops
    writer = {op.output: op.id for op in ops}
    first = {t.op_id: t.first_task for t in tg.tiles}
    checked = 0
    for tiles in tg.tiles:
        op = ops[tiles.op_id]
        if op.kind != "comm_put":
            continue
        prod = writer[op.inputs[0].buffer]
        n = op.inputs[0].shape[1]
        for k in range(tiles.num_tasks):
            task = tiles.first_task + k
            a, b = tile_bounds(n, op.attrs["tiles"][1], k)
            ptiles = tg.tiles[prod]
            want = {ptiles.first_task + i for i in range(ptiles.num_tasks)
                    if ptiles.tile_rect(i)[-1][0] < b and ptiles.tile_rect(i)[-1][1] > a}
            assert set(tg.preds[task]) == want, (op.name, k)
            checked += 1
        reduce = next(o for o in ops if o.inputs[1].buffer == op.output and o.kind != "comm_put")
        for k in range(tiles.num_tasks):
            assert tiles.first_task + k in tg.preds[first[reduce.id] + k]
    assert checked == 4 * (2 + 2 * 2)


def test_a_reduce_that_does_not_wait_for_the_signal_races(monkeypatch):
    """Without the signal wait (the put → reduce order across ranks), some schedule reduces a
    peer's slot before the put landed: a RaceError naming it."""
    import dataclasses

    from mpk.ops import registry

    opdef = registry.get_op("all_reduce")
    monkeypatch.setitem(registry._BY_TYPE_ID, opdef.type_id, dataclasses.replace(opdef, wait=None))
    graph, args = _embedding_graph()
    caught = []
    for seed in range(6):
        try:
            run_ranks(build_ranks(graph, 2, comm_tiles=2), args, seed=seed)
        except RaceError as e:
            caught.append(str(e))
    assert caught and "no put yet" in caught[0]
