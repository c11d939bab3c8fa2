"""Step 0 — split projections over K into accumulation tasks: decode projections with the
``split_k`` option (``split_k``), and, always, tensor-core GEMMs too small to fill the workers
(``split_gemms``).

A projection ``matmul`` qualifies when it is a plain decode linear (no prologue or epilogue; a
bias — the residual — is fine), 2-d x [M, K] @ W [K, N] with M ≤ LINEAR_ROWS, W a graph input
(a weight), and x is produced by an op that can split along K: some dim of the producer's
output that x's K dimension runs over is splittable for the producer's kind (attention's heads
behind the o-projection, the gate·up projection's columns behind the down-projection; not an
RMSNorm's rows, whose every tile covers all of K). It becomes ``matmul_partial`` over S slices
of K, writing fp32 planes [S, M, N], and ``matmul_finish``, which adds them in slice order and
applies alpha, beta and the bias (mpk/ops/splitk.py). The finish op keeps the projection's
name and output buffer, so its readers are unchanged; the partial op is named
``<name>.partial``.

Slices are whole *granules* of K so that their edges fall on the producer's tile edges where
they can: the producer's unit along K (the elements of K per step of the outermost dim that K
runs over and the producer may split: head_dim for attention's heads, head_dim × group for a
single-chunk attention tiled by kv heads, 1 for a projection's columns), rounded up to a
multiple of 32 when K is one (the decode linear's K step). The producer's own tiles are chosen
later (decompose), so a slice may still straddle two of them; dependencies stay exact either
way, since depend intersects each slice task's declared K range with every producer tile.
A projection of fewer than two granules stays whole; S is capped at K's granules.

``split_gemms``: a plain matmul that takes the tensor-core GEMM (more than LINEAR_ROWS rows, bf16
or fp16 operands as the GEMM reads them) runs one 128 × 128 sub-tile a task at best; with a
quarter of a wave of sub-tiles or fewer (a short prompt's projections, a decode batch of 17 to
a few hundred sequences) most workers would idle while a few stream the weights. It is split the
same way into S slices of whole GEMM k steps (64), S·sub-tiles ≤ the workers, each slice at
least GEMM_SPLIT_MIN_K long; its partial tasks run the GEMM over their slice.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from mpk.ir.opgraph import Op, OpGraph
from mpk.ir.regions import bounding_box
from mpk.ir.views import View, identity_view
from mpk.ops import get_op
from mpk.ops.gpu import ViewInfo
from mpk.ops.linalg import GEMM_COLS, GEMM_MIN_ROWS, GEMM_ROWS, LINEAR_ROWS, gemm_operand_blockers, linear_form
from mpk.ops.splitk import accumulation_dtype

K_STEP = 32  # cuda/mpk_tasks/linalg.cuh: the decode linear's K step (K % 32 == 0)
GEMM_K_STEP = 64  # cuda/mpk_tasks/gemm.cuh: kGemmK, the GEMM's k step (a slice's granule)
GEMM_SPLIT_MIN_K = 256  # a slice's K at least: four k steps, so the GEMM's stages fill before it ends


def split_k(graph: OpGraph, slices: int | None) -> OpGraph:
    """``graph`` with every qualifying projection split into ``slices`` K slices (module doc);
    ``graph`` itself is not modified (returned as is when nothing splits). ``slices`` None, 0
    or 1: ``graph`` unchanged."""
    if not slices or slices < 2:
        return graph
    producer = {op.output: op for op in graph.ops}
    picks = {}
    for op in graph.ops:
        granule = _granule(graph, op, producer)
        if granule and min(slices, op.inputs[0].shape[-1] // granule) >= 2:
            picks[op.id] = min(slices, op.inputs[0].shape[-1] // granule), granule
    return _rewrite(graph, picks)


def gemm_slices(m: int, n: int, k: int, workers: int) -> int:
    """K slices of an [m, n] GEMM over ``k``: 1 (whole) when its 128 × 128 sub-tiles fill more than
    a quarter of ``workers``; else as many as fill the workers, each at least GEMM_SPLIT_MIN_K of
    K. (Two slices cost more than they gain: the planes' fp32 traffic and the finish's hop.)"""
    subtiles = -(-m // GEMM_ROWS) * -(-n // GEMM_COLS)
    if 4 * subtiles > workers:
        return 1
    return max(1, min(workers // subtiles, k // GEMM_SPLIT_MIN_K))


def split_gemms(graph: OpGraph, workers: int, partition: Mapping[str, Any] | None = None) -> OpGraph:
    """``graph`` with every tensor-core GEMM too small for ``workers`` split over K (module doc);
    ``graph`` itself is not modified (returned as is when nothing splits). A matmul the
    ``partition`` overrides name (by its name or its kind) keeps the tiles they give."""
    named = set(partition or ())
    picks = {}
    for op in graph.ops:
        if _gemm_splittable(graph, op) and not {op.name, op.kind} & named:
            s = gemm_slices(*graph.buffers[op.output].shape, op.inputs[0].shape[1], workers)
            if s >= 2:
                picks[op.id] = s, GEMM_K_STEP
    return _rewrite(graph, picks)


def _rewrite(graph: OpGraph, picks: dict[int, tuple[int, int]]) -> OpGraph:
    """A copy of ``graph`` with each op of ``picks`` (id → (slices, granule)) split (``_split``),
    ops renumbered; ``graph`` itself when ``picks`` is empty."""
    if not picks:
        return graph
    g = copy.deepcopy(graph)
    ops: list[Op] = []
    for op in g.ops:
        ops.extend(_split(g, op, *picks[op.id]) if op.id in picks else [op])
    g.ops = ops
    for i, op in enumerate(g.ops):
        op.id = i
    return g


def _split(g: OpGraph, op: Op, s: int, granule: int) -> list[Op]:
    """``op`` as its partial op over ``s`` slices of ``granule`` and its finish op (module doc)."""
    a, b, *bias = op.inputs
    m, n = g.buffers[op.output].shape
    part = g.add_buffer(f"{op.name}.partial", (s, m, n), accumulation_dtype(g.buffers[op.output].dtype),
                        "intermediate")
    ends = {k: op.attrs[k] for k in ("alpha", "beta") if k in op.attrs}
    return [Op(-1, "matmul_partial", (a, b), part.id, {"slices": s, "granule": granule}, f"{op.name}.partial",
               op.source),
            Op(-1, "matmul_finish", (identity_view(part.id, part.shape), *bias), op.output, ends, op.name, op.source)]


def _plain_2d(g: OpGraph, op: Op) -> bool:
    """A plain matmul (no prologue or epilogue) x [M, K] @ W [K, N] into a 2-d output."""
    return (op.kind == "matmul" and linear_form(op.attrs) == (None, None) and len(g.buffers[op.output].shape) == 2
            and op.inputs[0].ndim == 2 and op.inputs[1].ndim == 2)


def _view_info(g: OpGraph, v: View) -> ViewInfo | None:
    strided = v.strided()
    if strided is None:
        return None
    buf = g.buffers[v.buffer]
    return ViewInfo(shape=v.shape, strides=strided[0], offset=strided[1], dtype=buf.dtype, buffer=v.buffer,
                    graph_input=buf.role == "input")


def _gemm_splittable(g: OpGraph, op: Op) -> bool:
    """A plain 2-d matmul the tensor-core GEMM runs (mpk.ops.linalg.linear_path), as a view of
    the graph sees it."""
    if not _plain_2d(g, op) or op.inputs[0].shape[0] < GEMM_MIN_ROWS:
        return False
    a, b = op.inputs[:2]
    va, vb = _view_info(g, a), _view_info(g, b)
    out = g.buffers[op.output].dtype
    return va is not None and vb is not None and not gemm_operand_blockers(va, vb, out)


def _granule(g: OpGraph, op: Op, producer: dict[int, Op]) -> int | None:
    """The K granule of a qualifying projection (module doc), None for any other op."""
    if not _plain_2d(g, op):
        return None
    a, b = op.inputs[:2]
    if a.shape[0] > LINEAR_ROWS or g.buffers[b.buffer].role != "input":
        return None
    src = producer.get(a.buffer)
    if src is None or a.shape[1] < 2:
        return None
    unit = _producer_unit(g, src, a)
    if unit is None:
        return None
    k = a.shape[1]
    return math.lcm(unit, K_STEP) if k % K_STEP == 0 else unit


def _producer_unit(g: OpGraph, src: Op, a: View) -> int | None:
    """Elements of K per step of the outermost dim of ``src``'s output that x's K runs over and
    ``src`` may split (None: no such dim, so every producer tile covers all of K). Found by
    mapping x's first half along K back to the producer's buffer: the dims whose range shrinks
    against all of K are the ones K runs over."""
    from mpk.compiler.partition import op_sig

    m, k = a.shape
    whole = bounding_box(a.base_regions(((0, m), (0, k))))
    half = bounding_box(a.base_regions(((0, m), (0, k // 2))))
    shape = g.buffers[a.buffer].shape
    splittable = get_op(src.kind).splittable(op_sig(g, src))
    over_k = [d for d in range(len(shape)) if half[d] != whole[d] and splittable[d]]
    if not over_k:
        return None
    return math.prod(shape[over_k[0] + 1:])
