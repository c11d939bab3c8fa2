"""Rules for view ops: reshapes, permutes, slices, expands and aliases become ``View`` steps and
move no data; a fresh copy only where a view must become a buffer of its own."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.pointwise import emit_pointwise
from mpk.frontend.rules.registry import handles, node_shape, norm_dim, slice_view
from mpk.frontend.values import Unsupported
from mpk.ir.views import View

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


@handles(aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.flatten,
         aten.view_as)
def _reshape(L, node, x: View, *args, **kwargs):
    if node.target is aten.view.dtype:  # the same packet: a bit reinterpretation, not a reshape
        raise Unsupported(f"Tensor.view({args[0]}) reinterprets the bits of a {L.graph.buffers[x.buffer].dtype} "
                          "tensor, which mpk does not lower")
    return x.then(("reshape", node_shape(L)))


@handles(aten.permute)
def _permute(L, node, x: View, dims):
    return x.then(("permute", tuple(norm_dim(d, x.ndim) for d in dims)))


@handles(aten.transpose.int)
def _transpose(L, node, x: View, d0, d1):
    perm = list(range(x.ndim))
    a, b = norm_dim(d0, x.ndim), norm_dim(d1, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return x.then(("permute", tuple(perm)))


@handles(aten.t)
def _t(L, node, x: View):
    return x.then(("permute", (1, 0))) if x.ndim == 2 else x


@handles(aten.expand)
def _expand(L, node, x: View, sizes, implicit=False):
    out = node_shape(L)
    if len(out) > x.ndim:
        x = x.then(("reshape", (1,) * (len(out) - x.ndim) + x.shape))
    return x.then(("expand", out))



@handles(aten.repeat.default)
def _repeat(L, node, x: View, repeats):
    # repeat is an expand of x between new unit dims, then a reshape joining each repeat with its
    # dim: [r0, n0, r1, n1, …] -> [r0·n0, r1·n1, …]; that reshape has no strided form unless every
    # r or n but the first is 1, and then the consumer's read materialises it as one copy op
    reps = tuple(int(r) for r in repeats)
    if len(reps) < x.ndim:
        raise Unsupported(f"repeat({list(reps)}) of a {x.ndim}-d tensor: fewer repeats than dims")
    shape = (1,) * (len(reps) - x.ndim) + x.shape
    if 0 in reps or 0 in shape:  # an empty result (a view step of size 0 has nothing to read)
        return emit_pointwise(L, "cast", [0], shape=node_shape(L), dtype=L.meta().dtype)
    spread = x.then(("reshape", tuple(d for n in shape for d in (1, n))))
    spread = spread.then(("expand", tuple(d for r, n in zip(reps, shape) for d in (r, n))))
    return spread.then(("reshape", tuple(r * n for r, n in zip(reps, shape))))

@handles(aten.slice.Tensor)
def _slice(L, node, x: View, dim=0, start=None, end=None, step=1):
    return slice_view(x, norm_dim(dim, x.ndim), start, end, step)


@handles(aten.select.int)
def _select(L, node, x: View, dim, index):
    d = norm_dim(dim, x.ndim)
    index = index + x.shape[d] if index < 0 else index
    return x.then(("slice", d, index, index + 1, 1)).then(("reshape", node_shape(L)))


@handles(aten.split.Tensor, aten.split_with_sizes)
def _split(L, node, x: View, sizes, dim=0):
    d = norm_dim(dim, x.ndim)
    n = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)]
    out, lo = [], 0
    for s in sizes:
        out.append(slice_view(x, d, lo, lo + s, 1))
        lo += s
    return tuple(out)


@handles(aten.unbind.int)
def _unbind(L, node, x: View, dim=0):
    d = norm_dim(dim, x.ndim)
    shape = x.shape[:d] + x.shape[d + 1:]
    return tuple(x.then(("slice", d, i, i + 1, 1)).then(("reshape", shape)) for i in range(x.shape[d]))


@handles(aten.alias, aten.detach)
def _alias(L, node, x: View, *args, **kwargs):
    return x


def _reaches_output(node: Node) -> bool:
    """Whether ``node``'s value, or a view of it (a piece of a split among them), is a graph
    output."""
    return any(u.op == "output" or (u.op == "call_function" and u.args[0] is node
                                    and (getattr(u.target, "is_view", False) or u.target is operator.getitem)
                                    and _reaches_output(u)) for u in node.users)


def fresh(L, node: Node, x: View) -> View:
    """The value of a copying op (clone, a same-dtype cast) whose result equals its source ``x``.
    The graph is functional, so a copy read inside it may share its source's buffer. One the
    caller receives must not: it would alias an input (whose mutation AOTAutograd applies after
    the graph, or the caller after the call) or another output, where eager PyTorch returns a
    tensor of its own (and `.contiguous()` a row-major one)."""
    root = node.args[0]
    while isinstance(root, Node) and root.op == "call_function" and getattr(root.target, "is_view", False):
        root = root.args[0]
    if isinstance(root, Node) and any(u.target is torch.ops.higher_order.auto_functionalized_v2 for u in root.users):
        # an op of the graph updates that buffer in place (a KV cache append), unseen by the
        # dependency analysis: the copy's order against it would be the schedule's
        raise Unsupported("a copy of a tensor the graph updates in place (a paged KV cache); copy it outside")
    return L.copy(x) if _reaches_output(node) else x


@handles(aten.lift_fresh_copy, aten.clone, aten.contiguous)
def _clone(L, node, x: View, *args, **kwargs):
    return fresh(L, node, x)


def _is_model_device(graph, device: torch.device) -> bool:
    """Whether ``device`` is where the graph's inputs of more than one element all are."""
    devices = {n.meta["val"].device for n in graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() > 1}
    return len(devices) == 1 and _same_device(next(iter(devices)), device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal, an unnamed index standing for the current one (``.to("cuda")``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@handles(aten._to_copy, prims.convert_element_type)
def _to(L, node, x: View, *args, **kwargs):
    dtype = L.meta().dtype
    src = node.args[0]
    # A one-element constant moved to the device of the graph's other inputs (a cache's constant
    # moved to the model's device in forward) is its value, which the executor holds where it
    # runs, as it holds the model. An argument stays where the caller put it (the executor takes
    # arguments on its device only); any other transfer is the caller's to make.
    target = kwargs.get("device")
    if target is not None and not _same_device(torch.device(target), src.meta["val"].device):
        if (src.meta["val"].numel() != 1 or src.op == "placeholder"
                or not _is_model_device(node.graph, torch.device(target))):
            raise Unsupported(f"a device transfer to {target} inside the graph")
    if dtype == L.graph.buffers[x.buffer].dtype:  # `.to(dtype, copy=True)` of its own dtype: a copy
        return fresh(L, node, x)
    return emit_pointwise(L, "cast", [x])


@handles(getattr(__import__("operator"), "getitem"))
def _getitem(L, node, seq, index):
    return seq[index]
