"""Graph-level test helpers: FX graphs traced and compiled straight to tables (with the
compiler's happens-before check, mpk.compiler.verify), random partitions, and an element-level
dependency oracle. The oracle enumerates elements and task ancestor sets, so it only fits small
graphs; it stays as an implementation independent of the check, to test the check against."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from mpk.compiler import compile_graph
from mpk.compiler.partition import op_sig
from mpk.compiler.tables import Tables
from mpk.frontend import fuse_patterns, lower
from mpk.ops import get_op


def op_forms(graph) -> list[str]:
    """Each op's kind, a matmul's named by its form (mpk.ops.linalg.op_form: ``rms_norm_matmul``,
    ``matmul_silu_mul``, …), in graph order."""
    from mpk.ops.linalg import op_form

    return [op_form(op.kind, op.attrs) for op in graph.ops]


def trace_graph(fn, args):
    """fn(*args) → OpGraph through the real frontend (make_fx gives the ATen graph)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    fuse_patterns(gm)
    return lower(gm)


def random_partition(graph, rng: random.Random, max_tiles: int = 5) -> dict[str, list[int]]:
    part = {}
    for op in graph.ops:
        sig = op_sig(graph, op)
        splittable = get_op(op.kind).splittable(sig)
        part[op.name] = [rng.randint(1, min(n, max_tiles)) if s else 1 for n, s in zip(sig.out_shape, splittable)]
    return part


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64, out64 = ref.double(), out.double()
    return float((out64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def _element_ids(tables: Tables, view: int) -> np.ndarray:
    v = tables.views[view]
    nd = int(v["ndim"])
    shape = [int(s) for s in v["shape"][:nd]]
    strides = [int(s) for s in v["strides"][:nd]]
    idx = np.full(shape, int(v["offset"]), dtype=np.int64)
    for d in range(nd):
        ar = np.arange(shape[d]) * strides[d]
        idx = idx + ar.reshape([-1 if i == d else 1 for i in range(nd)])
    return idx


def task_reachability(tables: Tables) -> list[set[int]]:
    """For every task, the set of tasks that must finish before it starts (via events)."""
    n = len(tables.tasks)
    anc: list[set[int]] = [set() for _ in range(n)]
    ev_anc: dict[int, set[int]] = {}
    trig_of: dict[int, list[int]] = {}
    for t in range(n):
        trig_of.setdefault(int(tables.tasks["trig_event"][t]), []).append(t)
    # tasks are in topological (linear) order: an event's triggers all precede its range
    for t in range(n):
        e = int(tables.tasks["dep_event"][t])
        if e not in ev_anc:
            s: set[int] = set()
            triggers = trig_of.get(e, [])
            # an event firing before all its triggers arrived guarantees none of them ran
            if int(tables.events["num_triggers"][e]) >= len(triggers):
                for p in triggers:
                    s |= anc[p] | {p}
            ev_anc[e] = s
        anc[t] = ev_anc[e]
    return anc


def check_dependencies(tables: Tables) -> int:
    """Oracle: every (writer, reader) pair whose elements overlap is ordered by events.
    Works on element ids from the tables' strided views, not on the compiler's rects, and
    shares no code with mpk.compiler.verify (which supersedes it outside tests: it scales and
    also covers in-place writes, unordered writers and the iteration's end). Returns the
    number of overlapping pairs checked."""
    from mpk.executors.interpreter import Interpreter

    interp = Interpreter(tables, check_races=False, validate_tables=False)
    anc = task_reachability(tables)
    writes: dict[int, list[tuple[int, set[int]]]] = {}
    reads: list[tuple[int, int, set[int]]] = []
    for t, rec in enumerate(tables.tasks):
        if rec["op"] < 0:
            continue
        op = interp.ops[int(rec["op"])]
        rect = op.tile_rect(int(rec["tile"]))
        shape = op.sig.out_shape
        ids = np.arange(int(np.prod(shape))).reshape(shape)[tuple(slice(a, b) for a, b in rect)]
        writes.setdefault(op.output, []).append((t, set(ids.reshape(-1).tolist())))
        for v, region in zip(op.inputs, op.opdef.input_regions(op.sig, rect)):
            if region is None:
                continue
            el = _element_ids(tables, v)[tuple(slice(a, b) for a, b in region)]
            reads.append((t, int(tables.views[v]["buffer"]), set(el.reshape(-1).tolist())))
    checked = 0
    for t, buf, els in reads:
        for w, wels in writes.get(buf, []):
            if els & wels:
                checked += 1
                assert w in anc[t], f"task {t} reads elements task {w} writes, but no event path orders them"
    return checked


def compile_with(graph, partition=None, num_workers=8):
    return compile_graph(graph, num_workers=num_workers, partition=partition, check=True)


def _rms(x, w):
    v = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(v + 1e-6) * w


def random_program(rng: random.Random):
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
