"""Pattern fusion on the ATen FX graph: RMSNorm, rotary embedding, SiLU·mul (and SiLU·mul
as the epilogue of the gate·up projection), the residual add after a projection and the
RMSNorm before one.

Each matcher looks for the decomposed form PyTorch produces for the usual model code and
replaces the root node by one call of an ``torch.ops.mpk`` fused op; intermediates left without
users are removed by dead-code elimination. Matchers accept operand order swaps and the dtype
casts Llama/Qwen code inserts. (Attention needs no FX pattern: SDPA arrives as one ATen op.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule, Node

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.moe import _match_expert_matmul
from mpk.ops.linalg import NORM_SPLIT_MIN_BYTES, NORM_TILE_BYTES

aten = torch.ops.aten
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, Node) else None


def _last_dim(node: Node, dim) -> bool:
    ndim = _val(node).dim()
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and dims[0] % ndim == ndim - 1


def _strip_cast(node):
    """(source, cast dtype or None) for a dtype cast node, else (node, None)."""
    if _is(node, *_CASTS) and not node.kwargs.get("device") and len(node.users) == 1:
        return node.args[0], _val(node).dtype
    return node, None


def _commuted(node: Node, pred: Callable[[object], bool]):
    """For a binary node, (matching operand, other operand) or None."""
    a, b = node.args[:2]
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def _match_rms_norm(node: Node):
    if not _is(node, aten.rsqrt.default):
        return None
    add = node.args[0]
    if not _is(add, aten.add.Scalar, aten.add.Tensor) or isinstance(add.args[1], Node):
        return None
    mean = add.args[0]
    if not (_is(mean, aten.mean.dim) and len(mean.args) > 2 and mean.args[2] and _last_dim(mean.args[0], mean.args[1])):
        return None
    sq = mean.args[0]
    if not (_is(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2):
        return None
    x32 = sq.args[0]
    muls = [u for u in node.users if _is(u, aten.mul.Tensor) and x32 in u.args[:2]]
    if len(muls) != 1:
        return None
    root, norm_dtype = muls[0], _val(muls[0]).dtype
    nxt = next(iter(root.users)) if len(root.users) == 1 else None
    if nxt is not None and _is(nxt, *_CASTS) and not nxt.kwargs.get("device"):
        root, norm_dtype = nxt, _val(nxt).dtype
        nxt = next(iter(root.users)) if len(root.users) == 1 else None
    weight = None
    if nxt is not None and _is(nxt, aten.mul.Tensor):
        other = nxt.args[1] if nxt.args[0] is root else nxt.args[0]
        d = _val(x32).shape[-1]
        if isinstance(other, Node) and _val(other) is not None and _val(other).dim() == 1 and _val(other).shape[0] == d:
            root, weight = nxt, other
    x, _ = _strip_cast(x32)
    replacement = (torch.ops.mpk.rms_norm.default,
                   (x, weight, float(add.args[1]), _val(x32).dtype, norm_dtype))
    return root, replacement


def _match_rope(node: Node):
    if not _is(node, aten.add.Tensor) or len(node.args) > 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for first, second in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (_is(first, aten.mul.Tensor) and _is(second, aten.mul.Tensor)):
            continue
        rot = _commuted(second, lambda n: _is(n, aten.cat.default))
        if rot is None:
            continue
        cat, sin = rot
        parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
        if len(parts) != 2 or not _is(parts[0], aten.neg.default):
            continue
        hi, lo = parts[0].args[0], parts[1]
        if not (_is(hi, aten.slice.Tensor) and _is(lo, aten.slice.Tensor)) or hi.args[0] is not lo.args[0]:
            continue
        x = hi.args[0]
        d = _val(x).shape[-1]
        if d % 2:  # the rope op rotates pairs: an odd last dim stays plain arithmetic
            continue
        if not (_last_dim(x, dim) and _last_dim(x, hi.args[1]) and _last_dim(x, lo.args[1])):
            continue
        if (hi.args[2], min(hi.args[3], d)) != (d // 2, d) or (lo.args[2], min(lo.args[3], d)) != (0, d // 2):
            continue
        direct = _commuted(first, lambda n: n is x)
        if direct is None or not all(isinstance(t, Node) for t in (direct[1], sin)):
            continue  # cos and sin must be tensors (x·2.0 + rotate_half(x)·sin is plain arithmetic)
        return node, (torch.ops.mpk.rope.default, (x, direct[1], sin))
    return None


def _match_silu_mul(node: Node):
    if not _is(node, aten.mul.Tensor):
        return None
    m = _commuted(node, lambda n: _is(n, aten.silu.default) and len(n.users) == 1)
    if m is None or not isinstance(m[1], Node):
        return None
    return node, (torch.ops.mpk.silu_mul.default, (m[0].args[0], m[1]))


def _half_slice(node, whole: int):
    """(source, 0 or 1) when ``node`` is the first or second half of its source's last dim."""
    if not (_is(node, aten.slice.Tensor) and len(node.users) == 1 and len(node.args) >= 2
            and _last_dim(node.args[0], node.args[1])):
        return None
    start, end, step = (list(node.args[2:5]) + [None, None, None])[:3]
    if step not in (None, 1):
        return None
    start, end = start or 0, whole if end is None else min(end, whole)
    return (node.args[0], 0) if (start, end) == (0, whole // 2) else \
        (node.args[0], 1) if (start, end) == (whole // 2, whole) else None


def _match_matmul_silu_mul(node: Node):
    """``silu_mul(h[:, :I], h[:, I:])`` of ``h = x @ b`` used by nothing else → ``matmul_silu_mul``:
    SiLU·mul becomes the projection's epilogue, saving a task, an event hop and a buffer."""
    if not _is(node, torch.ops.mpk.silu_mul.default):
        return None
    gate, up = node.args[:2]
    h = gate.args[0] if _is(gate, aten.slice.Tensor) else None
    if h is None or not _is(h, aten.mm.default) or _val(h).dim() != 2 or len(h.users) != 2:
        return None
    whole = _val(h).shape[1]
    if whole % 2 or _half_slice(gate, whole) != (h, 0) or _half_slice(up, whole) != (h, 1):
        return None
    return node, (torch.ops.mpk.matmul_silu_mul.default, tuple(h.args[:2]))


def _match_residual_matmul(node: Node):
    """``r + a @ b`` (the residual add after a projection) → ``addmm(r, a, b)``: the matmul
    task adds the residual in its epilogue, which saves a task, an event hop and a buffer."""
    if not _is(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    m = _commuted(node, lambda n: _is(n, aten.mm.default) and len(n.users) == 1)
    if m is None or not isinstance(m[1], Node):
        return None
    mm, r = m
    rv, mv = _val(r), _val(mm)
    if rv is None or tuple(rv.shape) != tuple(mv.shape) or rv.dtype != mv.dtype or _val(node).dtype != mv.dtype:
        return None
    return node, (aten.addmm.default, (r, mm.args[0], mm.args[1]))


def _match_rms_norm_matmul(node: Node):
    """``mm(rms_norm(x, w), b)`` or ``matmul_silu_mul(rms_norm(x, w), b)`` whose norm feeds nothing
    else → ``rms_norm_matmul``: the norm runs inside the projection's tasks, saving a task, an event
    hop and a buffer."""
    silu = _is(node, torch.ops.mpk.matmul_silu_mul.default)
    if not (silu or _is(node, aten.mm.default)):
        return None
    norm, b = node.args[:2]
    if not (_is(norm, torch.ops.mpk.rms_norm.default) and len(norm.users) == 1 and norm.args[1] is not None):
        return None
    x, weight, eps, compute_dtype, norm_dtype = norm.args
    xv = _val(x)
    if xv.dim() != 2 or _val(norm).dtype != _val(b).dtype:
        return None
    if xv.numel() * _val(norm).element_size() > NORM_TILE_BYTES:  # the task keeps all of x on chip
        return None
    return node, (torch.ops.mpk.rms_norm_matmul.default, (x, weight, eps, compute_dtype, norm_dtype, b, silu))


def _fake_like(val: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Metadata for a node this pass adds: a tensor like ``val`` (fake, on its device)."""
    return val.new_empty(tuple(shape), dtype=dtype or val.dtype)


def _add_node(gm: GraphModule, after: Node, target, args, val: torch.Tensor) -> Node:
    with gm.graph.inserting_after(after):
        node = gm.graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _norm_stats_rewriter(gm: GraphModule, num_workers: int, min_bytes: int = 0):
    """``norm @ b`` (or its SiLU·mul form) where the norm's input is a residual projection
    ``h = r + a @ w`` → ``matmul_norm_stats`` in place of h (its users take h from the packed
    output) and ``norm_stats_matmul`` in place of the projection: the producer writes h·g and
    per-group sums of h², so the norm needs no stage of its own and no task normalises a row
    (mpk.ops.linalg: matmul's norm_stats epilogue and prologue). Only norms of more than ``min_bytes`` of h: the
    prologue fusion, which applies after this one, takes the rest that fit its tile. The sums'
    group size suits h's split over ``num_workers`` tiles (mpk.ops.linalg.stats_group)."""
    from mpk.ops.linalg import stats_group

    def match(node: Node):
        if not _is(node, aten.mm.default, torch.ops.mpk.matmul_silu_mul.default):
            return None
        norm, b = node.args[:2]
        if not (_is(norm, torch.ops.mpk.rms_norm.default) and len(norm.users) == 1):
            return None
        h, g, eps, compute_dtype, norm_dtype = norm.args
        silu = _is(node, torch.ops.mpk.matmul_silu_mul.default)
        if not (_is(h, aten.addmm.default) and not h.kwargs and g is not None):
            return None
        r, a, w = h.args
        hv, bv = _val(h), _val(b)
        if not (hv.dim() == 2 and hv.dtype == torch.bfloat16 and _val(g).dtype == torch.bfloat16 and bv.dtype == torch.bfloat16
                and compute_dtype == torch.float32 and norm_dtype == torch.bfloat16 and _val(node).dtype == torch.bfloat16):
            return None
        M, N = hv.shape
        if hv.numel() * hv.element_size() <= min_bytes:
            return None
        if M > 16 or N % 256:  # the tasks: ≤ 16 rows a tile, a half warp per 16 or 32 groups of sums
            return None
        group = stats_group(M, N, num_workers)
        packed = _add_node(gm, h, torch.ops.mpk.matmul_norm_stats.default, (a, w, r, g, group),
                           _fake_like(hv, (3, M, N // group, group)))
        part = _add_node(gm, packed, aten.select.int, (packed, 0, 0), _fake_like(hv, (M, N // group, group)))
        h_new = _add_node(gm, part, aten.view.default, (part, [M, N]), _fake_like(hv, (M, N)))
        h.replace_all_uses_with(h_new)
        return node, (torch.ops.mpk.norm_stats_matmul.default, (packed, b, float(eps), bool(silu)))

    match.__name__ = "_match_norm_stats"
    return match


MATCHERS = (_match_rms_norm, _match_rope, _match_silu_mul, _match_matmul_silu_mul, _match_residual_matmul,
            _match_expert_matmul)
# CompileOptions.fuse_norm_prologue. Each task normalises its rows of x into shared memory
# after its gate (rms_norm's roundings: the result equals the unfused pair) and its K loop reads
# them from there: applying the norm inside the K loop would lengthen the path that sets the
# loop's pace.
# CompileOptions.fuse_norm_stats: the norm split between the projections around it
# (``_norm_stats_rewriter``; it also rewrites the producer, so it takes the graph module);
# "norm_stats_large" is its "auto" form, which leaves small norms to the prologue. Either
# applies before the prologue fusion (CompileOptions.optional_fusions).
OPTIONAL_MATCHERS = {"norm_prologue": lambda gm, workers: _match_rms_norm_matmul, "norm_stats": _norm_stats_rewriter,
                     "norm_stats_large": lambda gm, workers: _norm_stats_rewriter(gm, workers, NORM_SPLIT_MIN_BYTES)}


def fuse_patterns(gm: GraphModule, optional: tuple[str, ...] = (), num_workers: int = 128) -> dict[str, int]:
    """Rewrite every match in place; returns how many of each pattern were fused.
    ``optional``: names from ``OPTIONAL_MATCHERS`` to apply as well; ``num_workers``: the
    worker count the default partitioning targets (CompileOptions.num_workers)."""
    unknown = sorted(set(optional) - set(OPTIONAL_MATCHERS))
    if unknown:
        raise ValueError(f"unknown optional fusions {unknown}; known: {sorted(OPTIONAL_MATCHERS)}")
    matchers = MATCHERS + tuple(OPTIONAL_MATCHERS[name](gm, num_workers) for name in optional)
    counts = {m.__name__[len("_match_"):]: 0 for m in matchers}
    for matcher in matchers:
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False):  # removed by an earlier rewrite
                continue
            found = matcher(node)
            if found is None:
                continue
            root, (target, args) = found
            with gm.graph.inserting_after(root):
                new = gm.graph.call_function(target, args)
            new.meta = dict(root.meta)
            root.replace_all_uses_with(new)
            gm.graph.eliminate_dead_code()
            counts[matcher.__name__[len("_match_"):]] += 1
    gm.recompile()
    return counts


_SDPA = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def route_attention(gm: GraphModule) -> int:
    """On a Dynamo (torch-level) graph, turn ``F.scaled_dot_product_attention`` calls into
    ``torch.ops.mpk.attention`` so AOTAutograd keeps them whole on every device. Calls with
    dropout are left alone (they are then refused or run eagerly). Returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        bound = dict(zip(_SDPA_ARGS, node.args))
        bound.update(node.kwargs)
        if bound.get("dropout_p", 0.0) not in (0, 0.0):
            continue
        args = (bound["query"], bound["key"], bound["value"], bound.get("attn_mask"), bool(bound.get("is_causal", False)),
                bound.get("scale"), bool(bound.get("enable_gqa", False)))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.mpk.attention.default, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
