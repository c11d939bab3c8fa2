"""The seed paper's example — Q/K/V projections → attention → output projection → RMSNorm —
compiled with explicit partitions, checking the fused/normalized structure the paper
describes: fusion collapses one-event-per-edge into one event per group of tasks with equal
predecessors, and normalization adds dummy tasks only where a producer feeds consumers with
different predecessor sets."""

from __future__ import annotations

import torch

from mpk.compiler.tables import place_tables
from mpk.compiler.taskgraph import DUMMY
from mpk.executors import Interpreter
from mpk.inspection import compile_module
from mpk.testing.graphs import relative_error
from mpk.testing.toy_models import SeedExample, randomize

HIDDEN, HEADS = 64, 4


def _compile(partition):
    model = randomize(SeedExample(HIDDEN, HEADS), torch.Generator().manual_seed(0)).eval()
    x = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled = compile_module(model, (x,), {"partition": partition})
    return model, x, compiled


def _names(compiled):
    return {op.kind if op.kind in ("attention", "rms_norm") else op.name: op.name for op in compiled.graph.ops}


def _partition(qkv_tiles: dict[str, int]):
    # linear layers lower to matmuls over [1, 64] (as torch.compile traces them: a view and
    # an mm): tile N; attention per head; RMSNorm one row
    return {"mm": [1, qkv_tiles["q"]], "mm_1": [1, qkv_tiles["k"]], "mm_2": [1, qkv_tiles["v"]],
            "attention": [1, HEADS, 1, 1], "mm_3": [1, 4], "rms_norm": [1, 1, 1]}


def test_one_tile_per_head_needs_no_dummies():
    model, x, compiled = _compile(_partition({"q": 4, "k": 4, "v": 4}))
    s = compiled.stats
    # 12 projection tasks, 4 attention, 4 output-projection, 1 RMSNorm
    assert s.num_tasks == 21 and s.num_dummy_tasks == 0
    # edges: attention head h <- q_h, k_h, v_h (12); each o tile <- 4 heads (16); norm <- 4 o tiles (4)
    assert s.num_edges == 32 and s.events_before_fusion == 32
    # start (launches the 12 projections), one per head (3 triggers), one for the o-projection
    # (4 triggers, 4 launches), one for the norm (4 triggers)
    assert s.events_after_fusion == 7
    assert s.events_after_normalization == 8  # + the end event
    ev = compiled.tables.events
    assert sorted(int(e["num_triggers"]) for e in ev) == [1, 1, 3, 3, 3, 3, 4, 4]
    with torch.no_grad():
        ref = model(x)
    out = Interpreter(compiled.tables).run(_inputs(compiled, model, x))[0]
    assert relative_error(out, ref) <= 1e-5


def test_shared_value_tiles_need_dummies():
    """V projected in 2 tiles (2 heads each): v tile j feeds heads 2j and 2j+1, whose
    predecessor sets differ (their q/k tiles differ), so v tile j triggers two events and
    normalization gives it one fan-out event launching two dummy tasks."""
    model, x, compiled = _compile(_partition({"q": 4, "k": 4, "v": 2}))
    s = compiled.stats
    assert s.num_tasks - s.num_dummy_tasks == 19
    assert s.num_dummy_tasks == 4
    assert s.events_after_fusion == 7
    assert s.events_after_normalization == 7 + 2 + 1  # two fan-out events, the end event
    tg = compiled.taskgraph
    dummies = [t for t, op in enumerate(tg.task_op) if op == DUMMY]
    for d in dummies:  # each dummy is launched by a fan-out event with exactly one trigger (a v tile)
        fan = next(e for e in tg.events if d in e.launches)
        assert len(fan.triggers) == 1 and tg.graph.ops[tg.task_op[fan.triggers[0]]].name == "mm_2"
    with torch.no_grad():
        ref = model(x)
    for seed in range(20):
        out = Interpreter(place_tables(compiled.tables, 3)).run(_inputs(compiled, model, x), seed=seed)[0]
        assert relative_error(out, ref) <= 1e-5


def _inputs(compiled, model, x):
    named = {k: v.detach() for k, v in model.named_parameters()}
    return [named.get(b.name, x) for b in compiled.graph.inputs]
