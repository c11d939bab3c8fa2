"""Property tests over random op DAGs and random partitions (docs/architecture.md, the CPU interpreter).

A random program of tensor ops is traced through the real frontend, compiled with a random
partition, and checked: (1) every producer→consumer element overlap is ordered by events (the
compiler's happens-before check, run by ``compile_with``, and the element-level oracle, both
independent of the compiler's region analysis); (2) the tables'
structural invariants (one dependent / one triggering event per task, contiguous launch ranges,
topological order); (3) under 20 random schedules the interpreter, race detector on, matches
eager PyTorch.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpk.compiler.tables import place_tables, validate
from mpk.executors import Interpreter
from mpk.testing.graphs import (
    check_dependencies,
    compile_with,
    random_partition,
    random_program,
    relative_error,
    trace_graph,
)

SCHEDULES = 20
TOL = 1e-5  # relative to the reference's max |value|, fp32




@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_random_programs(seed):
    rng = random.Random(seed)
    fn, args = random_program(rng)
    graph = trace_graph(fn, args)
    compiled = compile_with(graph, partition=random_partition(graph, rng), num_workers=rng.randint(1, 6))
    tables = compiled.tables
    validate(tables)
    assert compiled.stats.verified is not None and compiled.stats.verified.tasks == len(tables.tasks)
    outputs = {op.output for op in graph.ops}
    chained = any(v.buffer in outputs for op in graph.ops for v in op.inputs)
    assert (check_dependencies(tables) > 0) == chained  # the oracle saw every producer→consumer pair
    expected = fn(*args)
    # the same tables re-placed on another worker count: any placement the compiler makes is legal
    interp = Interpreter(place_tables(tables, rng.randint(1, 5)))
    for schedule in range(SCHEDULES):
        outs = interp.run(args, seed=schedule)
        for o, e in zip(outs, expected):
            assert relative_error(o, e) <= TOL, f"schedule {schedule}: error {relative_error(o, e)}"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_fusion_reaches_the_fixpoint(seed):
    """Fusion's two passes leave nothing for either fusion to merge (random DAGs)."""
    from mpk.compiler.fuse import fuse, is_fixpoint
    from mpk.compiler.partition import decompose
    from mpk.ir.opgraph import OpGraph

    rng = random.Random(seed)
    n = rng.randint(1, 300)
    g = OpGraph()
    x = g.add_buffer("x", (n,), torch.float32, "input", input_index=0)
    from mpk.ir.views import identity_view
    g.add_op("copy", (identity_view(x.id, (n,)),), (n,), torch.float32, {}, "c")
    tg = decompose(g, 1, {"copy": [n]})
    tg.preds = [tuple(sorted(set(rng.randrange(t) for _ in range(rng.randint(0, min(t, 4)))))) if t else ()
                for t in range(n)]
    tg.num_edges = sum(map(len, tg.preds))
    fuse(tg)
    assert is_fixpoint(tg.events)
    covered = {(p, t) for e in tg.events for p in e.triggers for t in e.launches}
    assert covered == {(p, t) for t, ps in enumerate(tg.preds) for p in ps}  # exactly the edges
