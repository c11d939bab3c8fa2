"""Mixture-of-experts routing and expert GEMMs as ``torch.ops.mpk`` ops, and the graph rewrites
that produce them.

* ``route_moe`` (on the Dynamo graph, before AOTAutograd): ``F.one_hot(x, n)`` and
  ``torch.bincount(x, weights, minlength=n)`` become ``mpk.one_hot`` / ``mpk.bincount``, whose
  output sizes are static (``n``): AOTAutograd would decompose one_hot into run-time asserts and
  give bincount a data-dependent length (max(x) + 1). A bincount value ≥ minlength is reported at
  run time (BadInputError) instead of growing the output.
* ``_match_expert_matmul`` (pattern fusion on the ATen graph): a ``bmm`` whose operand is an expert
  weight gathered per row (``W[expert_ids]``, what transformers' ``batched_mm`` experts and plain
  gather + bmm / matmul / einsum MoE code trace to) becomes ``mpk.expert_bmm``: one grouped-GEMM op that
  reads each row's expert weight where it sits instead of materialising the gathered copy.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mpk.errors import UnsupportedOpError
from mpk.ir.regions import full_rect
from mpk.ops import OpSig, get_op

aten = torch.ops.aten


def _run(kind: str, inputs: list[torch.Tensor], out_shape: tuple[int, ...], out_dtype: torch.dtype,
         **attrs) -> torch.Tensor:
    sig = OpSig(tuple(tuple(t.shape) for t in inputs), out_shape, out_dtype, attrs)
    return get_op(kind).cpu(sig, full_rect(out_shape), inputs).contiguous()


@torch.library.custom_op("mpk::one_hot", mutates_args=())
def one_hot(x: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``F.one_hot(x, num_classes)`` (int64); an index outside [0, num_classes) raises BadInputError."""
    return _run("one_hot", [x], (*x.shape, num_classes), torch.int64)


@one_hot.register_fake
def _(x, num_classes):
    return x.new_empty((*x.shape, num_classes), dtype=torch.int64)


def bincount_dtype(weights: torch.dtype | None) -> torch.dtype:
    """The dtype eager ``torch.bincount`` returns for weights of this dtype (None: no weights)."""
    if weights is None:
        return torch.int64
    return torch.float32 if weights == torch.float32 else torch.float64


@torch.library.custom_op("mpk::bincount", mutates_args=())
def bincount(x: torch.Tensor, weights: torch.Tensor | None, minlength: int) -> torch.Tensor:
    """``torch.bincount(x, weights, minlength)`` with exactly ``minlength`` bins: a value outside
    [0, minlength) raises BadInputError (eager would lengthen the output)."""
    inputs = [x] if weights is None else [x, weights]
    return _run("histogram", inputs, (minlength,), bincount_dtype(None if weights is None else weights.dtype), mode="bincount")


@bincount.register_fake
def _(x, weights, minlength):
    return x.new_empty((minlength,), dtype=bincount_dtype(None if weights is None else weights.dtype))


@torch.library.custom_op("mpk::expert_bmm", mutates_args=())
def expert_bmm(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, gathered: int) -> torch.Tensor:
    """``torch.bmm(a[index], b)`` (``gathered`` 0) or ``torch.bmm(a, b[index])`` (1) without the
    gathered copy; a negative index counts from the end, one outside the experts raises BadInputError."""
    return _run("expert_matmul", [a, b, index], _bmm_shape(a, b, index), torch.promote_types(a.dtype, b.dtype),
                gathered=gathered)


def _bmm_shape(a, b, index) -> tuple[int, int, int]:
    return int(index.shape[0]), int(a.shape[1]), int(b.shape[2])


@expert_bmm.register_fake
def _(a, b, index, gathered):
    return a.new_empty(_bmm_shape(a, b, index), dtype=torch.promote_types(a.dtype, b.dtype))


# --- the Dynamo-graph rewrite ------------------------------------------------------------------

_ONE_HOT = {torch.nn.functional.one_hot, torch._C._nn.one_hot}


def _bound(node: Node, names: tuple[str, ...]) -> dict:
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    return args


def _drop_size_asserts(gm: GraphModule, node: Node, n: int) -> None:
    """Dynamo guards a data-dependent length with ``_assert_scalar(size >= minlength)``; the
    rewritten node's length is ``n``: its size reads become ``n`` and the asserts on them go."""
    for size in [u for u in node.users if u.op == "call_function" and u.target is aten.sym_size.int]:
        for check in list(size.users):
            for a in [u for u in check.users if u.op == "call_function" and u.target is aten._assert_scalar.default]:
                gm.graph.erase_node(a)
            if not check.users:
                gm.graph.erase_node(check)
        size.replace_all_uses_with(n)
        gm.graph.erase_node(size)


def route_moe(gm: GraphModule) -> int:
    """On a Dynamo graph, turn ``F.one_hot`` and ``torch.bincount`` calls into ``mpk.one_hot`` /
    ``mpk.bincount`` (module docstring). Raises UnsupportedOpError for a bincount without minlength
    (its length would be data-dependent). Returns how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ONE_HOT:
            # (Dynamo itself refuses num_classes=-1, the data-dependent class count)
            args = _bound(node, ("input", "num_classes"))
            n = args["num_classes"]
            target, new_args = torch.ops.mpk.one_hot.default, (args["input"], n)
        elif (node.op == "call_function" and node.target is torch.bincount) or (
                node.op == "call_method" and node.target == "bincount"):
            args = _bound(node, ("input", "weights", "minlength"))
            n = args.get("minlength", 0)
            if not isinstance(n, int) or n < 1:
                raise UnsupportedOpError(f"bincount with minlength={n!r}: its length would be data-dependent "
                                         "(max(x) + 1); pass minlength, a positive int, the bin count (values "
                                         "must lie in [0, minlength))")
            target, new_args = torch.ops.mpk.bincount.default, (args["input"], args.get("weights"), n)
        else:
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(target, new_args)
        new.meta = {k: v for k, v in node.meta.items() if k not in ("example_value", "val")}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        _drop_size_asserts(gm, new, n)
        count += 1
    if count:
        gm.recompile()
    return count


# --- the ATen-graph pattern --------------------------------------------------------------------

def _val(node) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, Node) else None


# ops that leave a tensor's shape (and so each row's slice) as it is
_SAME_SHAPE = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
               aten.clone.default)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _skip_same_shape(node):
    while _call(node, *_SAME_SHAPE) and tuple(_val(node).shape) == tuple(_val(node.args[0]).shape):
        node = node.args[0]
    return node


def _gathered_weight(node) -> tuple[Node, Node, tuple[int, ...], int | None] | None:
    """(weight, index, dims, rows) where ``node`` is ``weight[index]`` of a 3-D weight seen
    through what keeps each row's slice its own: permutes that keep dim 0 first (einsum's),
    same-shape views, and the flatten of an n-D index's leading dims into ``rows`` rows
    (``W[idx] @ x`` with idx of [tokens, k]; None: a 1-D index). ``dims``: the permute that
    turns the weight into the operand's layout."""
    dims = (0, 1, 2)
    node = _skip_same_shape(node)
    while _call(node, aten.permute.default):
        p = [d % 3 for d in node.args[1]]
        dims = tuple(p[t] for t in dims)
        node = _skip_same_shape(node.args[0])
    if dims[0] != 0:
        return None
    rows = None
    if _call(node, *_RESHAPES):
        rows, trailing = int(_val(node).shape[0]), tuple(_val(node).shape[1:])
        node = _skip_same_shape(node.args[0])
        if _val(node).dim() < 3 or tuple(_val(node).shape[-2:]) != trailing:
            return None
    found = _plain_gather(node)
    if found is None or (rows is None and _val(found[1]).dim() != 1):
        return None
    return (*found, dims, rows)


def _plain_gather(node) -> tuple[Node, Node] | None:
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.index.Tensor):
        return None
    weight, indices = node.args[0], node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], Node) or _val(weight).dim() != 3:
        return None
    if _val(indices[0]).dtype not in (torch.int64, torch.int32):
        return None
    return weight, indices[0]


def _match_expert_matmul(node: Node):
    """``bmm(W[idx], b)`` / ``bmm(a, W[idx])`` → ``mpk.expert_bmm`` (module docstring)."""
    if not (node.op == "call_function" and node.target is aten.bmm.default):
        return None
    for gathered in (0, 1):
        found = _gathered_weight(node.args[gathered])
        if found is None:
            continue
        weight, index, dims, rows = found
        with node.graph.inserting_before(node):
            if rows is not None:  # an n-D index whose gathered rows were flattened: flatten it too
                flat = node.graph.call_function(aten.reshape.default, (index, [rows]))
                flat.meta = {"val": _val(index).reshape(rows)}
                index = flat
            if dims != (0, 1, 2):  # the operand's layout, on the weight itself
                permuted = node.graph.call_function(aten.permute.default, (weight, list(dims)))
                permuted.meta = {"val": _val(weight).permute(dims)}
                weight = permuted
        operands = [node.args[0], node.args[1]]
        operands[gathered] = weight
        return node, (torch.ops.mpk.expert_bmm.default, (*operands, index, gathered))
    return None
