"""Property tests over random op DAGs and random partitions (DESIGN.md §5).

A random program of tensor ops is traced through the real frontend, compiled with a random
partition, and checked: (1) every producer→consumer element overlap is ordered by events
(element-level oracle, independent of the compiler's region analysis); (2) the tables'
structural invariants (one dependent / one triggering event per task, contiguous launch ranges,
topological order); (3) under 20 random schedules the interpreter, race detector on, matches
eager PyTorch.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpk.testing.graphs import check_dependencies, compile_with, random_partition, relative_error, trace_graph
from mpk.compiler.tables import validate
from mpk.executors import Interpreter

SCHEDULES = 20
TOL = 1e-5  # relative to the reference's max |value|, fp32


def _rms(x, w):
    v = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(v + 1e-6) * w


def build_program(rng: random.Random):
    """A random straight-line program over 3-d fp32 tensors; returns (fn, args)."""
    b, m, n = rng.randint(1, 3), rng.randint(1, 6), rng.choice([2, 4, 6, 8])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    args = [torch.randn(b, m, n, generator=gen), torch.randn(b, m, n, generator=gen),
            torch.randn(n, generator=gen) + 1.0, torch.randn(n, n, generator=gen) / n ** 0.5]
    steps = [rng.randrange(13) for _ in range(rng.randint(2, 7))]
    picks = [rng.randrange(i + 2) for i in range(len(steps))]  # second operand: any earlier value

    def fn(x, y, w, mat):
        live = [x, y]
        for s, pick in zip(steps, picks):
            a, c = live[-1], live[pick]
            if s == 0:
                out = a + c
            elif s == 1:
                out = a * torch.sigmoid(c)
            elif s == 2:
                out = a @ mat  # matmul over the last dim
            elif s == 3:
                out = torch.softmax(a, dim=-1)
            elif s == 4:
                out = _rms(a, w)
            elif s == 5:
                out = (a.transpose(1, 2) * 0.5).transpose(1, 2).contiguous() - c
            elif s == 6:
                half = a.shape[-1] // 2
                out = torch.cat([a[..., half:], c[..., :half]], dim=-1)
            elif s == 7:
                out = a - a.amax(-1, keepdim=True) + c.mean(-1, keepdim=True)
            elif s == 8:
                out = F.layer_norm(a, (a.shape[-1],), w, None, 1e-5)
            elif s == 9:
                out = F.silu(a) * c
            elif s == 10:
                bb, mm, nn_ = a.shape
                out = a.reshape(bb, mm * nn_).tanh().reshape(bb, mm, nn_) + c
            elif s == 11:  # two heads of causal attention, GQA-free: [b, m, n] -> [b, 2, m, n/2]
                bb, mm, nn_ = a.shape
                q = a.view(bb, mm, 2, nn_ // 2).transpose(1, 2)
                kv = c.view(bb, mm, 2, nn_ // 2).transpose(1, 2)
                out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True).transpose(1, 2).reshape(bb, mm, nn_)
            else:  # batched matmul against a transposed view
                out = torch.bmm(a, c.transpose(1, 2)) @ c
            live.append(out)
        return live[-1], live[len(live) // 2], live[-1].sum(-1)

    return fn, args


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_random_programs(seed):
    rng = random.Random(seed)
    fn, args = build_program(rng)
    graph = trace_graph(fn, args)
    compiled = compile_with(graph, partition=random_partition(graph, rng), num_workers=rng.randint(1, 6))
    tables = compiled.tables
    validate(tables)
    outputs = {op.output for op in graph.ops}
    chained = any(v.buffer in outputs for op in graph.ops for v in op.inputs)
    assert (check_dependencies(tables) > 0) == chained  # the oracle saw every producer→consumer pair
    expected = fn(*args)
    interp = Interpreter(tables, num_workers=rng.randint(1, 5))
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
