"""Lowering rules: ATen op → View (view ops) or registry op (compute ops).

``HANDLERS`` maps an ATen overload (or a whole overload packet) to a function
``(lowering, node, *args, **kwargs) -> value``; tensors arrive as ``View``s. A rule raises
``Unsupported`` with the reason when an argument combination is outside what it lowers.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.lower import ScalarConst, Unavailable, Unsupported
from mpk.ir.views import View
from mpk.ops.pointwise import INT_FNS
from mpk.ops.rows import SORT_MAX

if TYPE_CHECKING:
    from mpk.frontend.lower import Lowering

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk
HANDLERS: dict[Any, Callable] = {}


def lookup(target) -> Callable | None:
    return HANDLERS.get(target) or HANDLERS.get(getattr(target, "overloadpacket", None))


_FASTPATH = ("PyTorch's fused inference path for nn.TransformerEncoderLayer / nn.MultiheadAttention, which mpk "
             "does not lower; call torch.backends.mha.set_fastpath_enabled(False) before compiling and the layer "
             "traces as the matmuls, softmax and layer norms mpk runs")
# What to do about an op with no lowering rule, where there is something to do
NO_RULE_HINTS = {
    aten._transformer_encoder_layer_fwd: _FASTPATH,
    aten._native_multi_head_attention: _FASTPATH,
    aten.native_dropout: "dropout with p > 0: mpk compiles inference (call model.eval(); "
                         "scaled_dot_product_attention with dropout_p=0)",
}


def no_rule_reason(target) -> str:
    """Why ``target`` cannot be lowered, with what to do where a hint exists."""
    hint = NO_RULE_HINTS.get(getattr(target, "overloadpacket", target))
    return "no lowering rule for this ATen op" + (f": {hint}" if hint else "")


def handles(*targets):
    def deco(fn):
        for t in targets:
            HANDLERS[t] = fn
        return fn
    return deco


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _shape(L: Lowering) -> tuple[int, ...]:
    return tuple(int(s) for s in L.meta().shape)


# --- views (no data moves) ---------------------------------------------------------------

@handles(aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.flatten,
         aten.view_as)
def _reshape(L, node, x: View, *args, **kwargs):
    if node.target is aten.view.dtype:  # the same packet: a bit reinterpretation, not a reshape
        raise Unsupported(f"Tensor.view({args[0]}) reinterprets the bits of a {L.graph.buffers[x.buffer].dtype} "
                          "tensor, which mpk does not lower")
    return x.then(("reshape", _shape(L)))


@handles(aten.permute)
def _permute(L, node, x: View, dims):
    return x.then(("permute", tuple(_dim(d, x.ndim) for d in dims)))


@handles(aten.transpose.int)
def _transpose(L, node, x: View, d0, d1):
    perm = list(range(x.ndim))
    a, b = _dim(d0, x.ndim), _dim(d1, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return x.then(("permute", tuple(perm)))


@handles(aten.t)
def _t(L, node, x: View):
    return x.then(("permute", (1, 0))) if x.ndim == 2 else x


@handles(aten.expand)
def _expand(L, node, x: View, sizes, implicit=False):
    out = _shape(L)
    if len(out) > x.ndim:
        x = x.then(("reshape", (1,) * (len(out) - x.ndim) + x.shape))
    return x.then(("expand", out))


def _slice_view(x: View, dim: int, start, end, step: int) -> View:
    n = x.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = max(0, min(start, n)), max(0, min(end, n))
    end = max(end, start)
    return x.then(("slice", dim, start, end, step))


@handles(aten.slice.Tensor)
def _slice(L, node, x: View, dim=0, start=None, end=None, step=1):
    return _slice_view(x, _dim(dim, x.ndim), start, end, step)


@handles(aten.select.int)
def _select(L, node, x: View, dim, index):
    d = _dim(dim, x.ndim)
    index = index + x.shape[d] if index < 0 else index
    return x.then(("slice", d, index, index + 1, 1)).then(("reshape", _shape(L)))


@handles(aten.split.Tensor, aten.split_with_sizes)
def _split(L, node, x: View, sizes, dim=0):
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)]
    out, lo = [], 0
    for s in sizes:
        out.append(_slice_view(x, d, lo, lo + s, 1))
        lo += s
    return tuple(out)


@handles(aten.unbind.int)
def _unbind(L, node, x: View, dim=0):
    d = _dim(dim, x.ndim)
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


def _fresh(L, node: Node, x: View) -> View:
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
    return _fresh(L, node, x)


@handles(aten._to_copy, prims.convert_element_type)
def _to(L, node, x: View, *args, **kwargs):
    dtype = L.meta().dtype
    if kwargs.get("device") is not None and kwargs["device"] != node.args[0].meta["val"].device:
        raise Unsupported(f"a device transfer to {kwargs['device']} inside the graph")
    if dtype == L.graph.buffers[x.buffer].dtype:  # `.to(dtype, copy=True)` of its own dtype: a copy
        return _fresh(L, node, x)
    return _emit_pointwise(L, "cast", [x])


@handles(getattr(__import__("operator"), "getitem"))
def _getitem(L, node, seq, index):
    return seq[index]


# --- pointwise ---------------------------------------------------------------------------

def _integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def _emit_pointwise(L, fn: str, args, shape=None, dtype: torch.dtype | None = None, extra: float | None = None) -> View:
    """One ``pointwise`` op of ``fn`` over ``args`` (Views, numbers, ScalarConsts), in the
    exact integer form where the result and every operand are integers or bools, in the float64
    form where torch computes in float64 (_compute_dtype). The result's shape and dtype default
    to the node's."""
    inputs: list[View] = []
    spec: list[list] = []
    for a in args:
        if isinstance(a, View):
            spec.append(["in", len(inputs)])
            inputs.append(a)
        elif isinstance(a, ScalarConst):
            spec.append(["c", a.value])
        elif isinstance(a, (int, float, bool)):
            spec.append(["c", a])
        else:
            raise Unsupported(f"argument {a!r} of type {type(a).__name__} is not a tensor or number")
    if not inputs and fn not in ("cast", "arange"):
        raise Unsupported("no tensor operand")
    out_dtype = L.meta().dtype if dtype is None else dtype
    if _integral(out_dtype) and fn in ("cast", "where"):
        # a fill value (full, fill_, masked_fill) is converted to the tensor's integer dtype first
        spec = [["c", _converted(c, out_dtype, True)] if kind == "c" else [kind, c] for kind, c in spec]
    exact_int = (_integral(out_dtype) and all(_integral(L.graph.buffers[v.buffer].dtype) for v in inputs)
                 and not any(isinstance(c, float) for kind, c in spec if kind == "c"))
    if exact_int:
        # a number meets integer tensors in the dtype they and it promote to (int32 < 2**33
        # compares with 2**33 wrapped to 0; a bool mask times 2 counts in int64); where's
        # condition does not count
        values = [v for (kind, c), v in zip([a for a in spec if a[0] == "in"], inputs) if not (fn == "where" and c == 0)]
        common = functools.reduce(torch.promote_types, [L.graph.buffers[v.buffer].dtype for v in values], out_dtype
                                  if not values else L.graph.buffers[values[0].buffer].dtype)
        spec = [["c", _converted(c, torch.result_type(torch.empty(1, dtype=common), c), fn in _CHECKED_NUMBERS)]
                if kind == "c" else [kind, c] for kind, c in spec]
    if exact_int and fn not in INT_FNS:
        raise Unsupported(f"{fn} of integer operands with an integer result")
    if not exact_int and fn.startswith("bitwise_"):
        raise Unsupported(f"{fn} of floating-point operands")
    compute = _compute_dtype(L, fn, spec, inputs)
    if fn in _COMPARISONS and compute in (torch.float16, torch.bfloat16):
        # torch compares in a 16-bit float dtype with every operand rounded to it (x == 0.3 holds
        # for bfloat16's 0.30078125, numbers and 0-d float32 tensors alike); arithmetic takes a
        # number as it is
        with unset_fake_temporarily():
            spec = [["c", torch.tensor(c, dtype=compute).item()] if kind == "c" else [kind, c] for kind, c in spec]
        inputs = [v if L.graph.buffers[v.buffer].dtype == compute
                  else _emit_pointwise(L, "cast", [v], shape=v.shape, dtype=compute) for v in inputs]
    # float64 results, and integer or bool ones (comparisons, casts) of operands promoted to float64
    f64 = out_dtype == torch.float64 or (not out_dtype.is_floating_point and compute == torch.float64)
    form = "int" if exact_int else "f64" if f64 else None
    attrs = {"fn": fn, "args": spec, **({"form": form} if form else {}),
             **({"extra": float(extra)} if extra is not None else {})}
    return L.emit("pointwise", inputs, attrs, shape=shape, dtype=out_dtype)


def _compute_dtype(L, fn: str, spec: list[list], inputs: list[View]) -> torch.dtype | None:
    """The dtype torch promotes an elementwise op's operands to (where's condition aside), by its
    rule that 0-d tensors and numbers defer to dimensioned tensors of their kind (float32 > a 0-d
    float64 compares in float32); None without operands. Pairwise, so exact for the one- and
    two-operand ops whose form it decides (casts, comparisons, logical ops), not for every mix of
    three."""
    acc = None
    with unset_fake_temporarily():
        for j, (kind, c) in enumerate(spec):
            if fn == "where" and j == 0:
                continue
            if kind == "in":
                v = inputs[c]
                t = torch.empty((1,) if v.ndim else (), dtype=L.graph.buffers[v.buffer].dtype)
            else:
                t = torch.tensor(c) if acc is None else c  # a lone number: as torch.tensor would hold it
            if acc is None:
                acc = t
            else:
                dimensioned = any(isinstance(x, torch.Tensor) and x.ndim for x in (acc, t))
                acc = torch.empty((1,) if dimensioned else (), dtype=torch.result_type(acc, t))
    return None if acc is None else acc.dtype


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")

# functions whose number operand torch converts with a range check (a fill value, a bound):
# one that does not fit the integer dtype is an error there, not wrapped
_CHECKED_NUMBERS = ("cast", "where", "clamp", "maximum", "minimum")


def _converted(value, dtype: torch.dtype, checked: bool):
    """A Python number as a tensor of integer or bool ``dtype`` holds it — truncated toward zero
    and wrapped to the type's width, as torch converts a scalar operand, or (``checked``) refused
    where it does not fit, as torch refuses such a fill value or bound."""
    try:
        with unset_fake_temporarily():  # lowering may run under the tracer's fake tensors
            return (torch.full((), value, dtype=dtype) if checked else torch.tensor(value).to(dtype)).item()
    except (RuntimeError, OverflowError, ValueError) as e:
        raise Unsupported(f"the number {value!r} as {str(dtype)[6:]}: {e}") from None


def _elementwise(fn):
    """Mark a rule that takes ScalarConst operands (lower.refuse_unavailable)."""
    fn.takes_scalars = True
    return fn


def _pointwise(fn: str):
    @_elementwise
    def handler(L, node, *args, **kwargs):
        alpha = kwargs.get("alpha", 1)
        if alpha != 1:
            raise Unsupported(f"alpha={alpha} (only alpha=1 is lowered)")
        if kwargs.get("rounding_mode"):
            raise Unsupported(f"rounding_mode={kwargs['rounding_mode']!r}")
        return _emit_pointwise(L, fn, args)
    return handler


for _fn, _targets in {
    "add": (aten.add.Tensor, aten.add.Scalar), "sub": (aten.sub.Tensor, aten.sub.Scalar),
    "mul": (aten.mul.Tensor, aten.mul.Scalar), "div": (aten.div.Tensor, aten.div.Scalar),
    "pow": (aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar), "neg": (aten.neg.default,),
    "exp": (aten.exp.default,), "rsqrt": (aten.rsqrt.default,), "sqrt": (aten.sqrt.default,),
    "silu": (aten.silu.default,), "sigmoid": (aten.sigmoid.default,),
    "tanh": (aten.tanh.default,), "relu": (aten.relu.default,), "abs": (aten.abs.default,),
    "log": (aten.log.default,), "sin": (aten.sin.default,), "cos": (aten.cos.default,),
    "reciprocal": (aten.reciprocal.default,), "erf": (aten.erf.default,), "log1p": (aten.log1p.default,),
    "expm1": (aten.expm1.default,), "floor": (aten.floor.default,), "ceil": (aten.ceil.default,),
    "round": (aten.round.default,), "trunc": (aten.trunc.default,), "sign": (aten.sign.default,),
    "maximum": (aten.maximum.default, aten.clamp_min.default, aten.clamp_min.Tensor),
    "minimum": (aten.minimum.default, aten.clamp_max.default, aten.clamp_max.Tensor),
    "eq": (aten.eq.Tensor, aten.eq.Scalar), "ne": (aten.ne.Tensor, aten.ne.Scalar),
    "lt": (aten.lt.Tensor, aten.lt.Scalar), "le": (aten.le.Tensor, aten.le.Scalar),
    "gt": (aten.gt.Tensor, aten.gt.Scalar), "ge": (aten.ge.Tensor, aten.ge.Scalar),
    "where": (aten.where.self,), "logical_and": (aten.logical_and.default,),
    "logical_or": (aten.logical_or.default,), "logical_xor": (aten.logical_xor.default,),
    "logical_not": (aten.logical_not.default,), "hardsigmoid": (aten.hardsigmoid.default,),
    "hardswish": (aten.hardswish.default,), "mish": (aten.mish.default,),
}.items():
    handles(*_targets)(_pointwise(_fn))


@handles(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_or.Tensor, aten.bitwise_or.Scalar,
         aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_not.default)
@_elementwise
def _bitwise(L, node, *args):
    # on bools (masks: `a & b`, `~m`) the logical form, which the float path also has
    fn = node.target.overloadpacket.__name__
    if L.meta().dtype == torch.bool:
        fn = "logical_" + fn.removeprefix("bitwise_")
    return _emit_pointwise(L, fn, args)


@handles(aten.scalar_tensor.default)
def _scalar_tensor(L, node, value, **kwargs):
    return ScalarConst(f"a tensor made inside forward from the number {value} (torch.tensor / scalar_tensor): pass "
                       "it as an input or register it as a buffer", value)


# --- tensors made inside forward: a fill or a count, computed by the kernel -----------------------

@handles(aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill.Scalar, aten.fill.Tensor)
@_elementwise
def _fill(L, node, *args, **kwargs):
    return _emit_pointwise(L, "cast", [args[-1]])  # the fill value comes last (after a size or a tensor)


@handles(aten.zeros.default, aten.ones.default, aten.zeros_like.default, aten.ones_like.default,
         aten.empty.memory_format, aten.empty_like.default, aten.new_zeros.default, aten.new_ones.default,
         aten.new_empty.default)
def _zeros_ones(L, node, *args, **kwargs):
    # an empty tensor's elements are whatever: zeros (functionalization has turned the in-place
    # ops that fill it into ops that read it)
    return _emit_pointwise(L, "cast", [int("ones" in node.target.overloadpacket.__name__)])


@handles(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(L, node, *args, **kwargs):
    start, _, step = (0, *args, 1) if len(args) == 1 else (*args, 1)[:3]
    if _integral(L.meta().dtype):  # torch counts from the truncated start by the truncated step
        start, step = int(start), int(step)
    return _emit_pointwise(L, "arange", [start, step])


@handles(aten.rsub.Scalar, aten.rsub.Tensor)
@_elementwise
def _rsub(L, node, x, other, alpha=1):
    return _pointwise("sub")(L, node, other, x, alpha=alpha)


@handles(aten.gelu.default)
def _gelu(L, node, x: View, approximate="none"):
    fn = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if fn is None:
        raise Unsupported(f"approximate={approximate!r}, expected 'none' or 'tanh'")
    return _emit_pointwise(L, fn, [x])


@handles(aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default)
@_elementwise
def _clamp(L, node, x, lo=None, hi=None):
    if node.target is aten.hardtanh.default:
        lo = -1.0 if lo is None else lo
        hi = 1.0 if hi is None else hi
    if lo is None and hi is None:
        raise Unsupported("clamp with neither min nor max")
    if lo is None or hi is None:
        return _emit_pointwise(L, "maximum" if hi is None else "minimum", [x, hi if lo is None else lo])
    return _emit_pointwise(L, "clamp", [x, lo, hi])


@handles(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
@_elementwise
def _masked_fill(L, node, x, mask, value):
    return _emit_pointwise(L, "where", [mask, value, x])


@handles(aten.leaky_relu.default)
def _leaky_relu(L, node, x: View, negative_slope=0.01):
    return _emit_pointwise(L, "leaky_relu", [x, negative_slope])


@handles(aten._prelu_kernel.default)
def _prelu(L, node, x: View, weight: View):
    return _emit_pointwise(L, "leaky_relu", [x, weight])  # the slope a tensor broadcast over x


@handles(aten.elu.default)
def _elu(L, node, x: View, alpha=1.0, scale=1, input_scale=1):
    return _emit_pointwise(L, "elu", [x, alpha, scale], extra=input_scale)


@handles(aten.celu.default)
def _celu(L, node, x: View, alpha=1.0):
    return _emit_pointwise(L, "elu", [x, alpha, 1.0], extra=1.0 / alpha)


@handles(aten.threshold.default)
def _threshold(L, node, x: View, threshold, value):
    return _emit_pointwise(L, "threshold", [x, threshold, value])


@handles(aten.log_sigmoid_forward.default)
def _log_sigmoid(L, node, x: View):
    return _emit_pointwise(L, "log_sigmoid", [x]), Unavailable("the buffer output of log_sigmoid_forward")


@handles(aten.glu.default)
def _glu(L, node, x: View, dim=-1):
    d = _dim(dim, x.ndim)
    half = x.shape[d] // 2
    return _emit_pointwise(L, "glu", [_slice_view(x, d, 0, half, 1), _slice_view(x, d, half, 2 * half, 1)])


@handles(aten.pixel_shuffle.default)
def _pixel_shuffle(L, node, x: View, r: int):
    *lead, c, h, w = x.shape
    n = len(lead)
    split = x.then(("reshape", (*lead, c // (r * r), r, r, h, w)))
    moved = split.then(("permute", (*range(n), n, n + 3, n + 1, n + 4, n + 2)))
    return moved.then(("reshape", _shape(L)))


@handles(aten.softplus.default)
def _softplus(L, node, x: View, beta=1, threshold=20):
    return _emit_pointwise(L, "softplus", [x, beta, threshold])


# --- reductions and row ops --------------------------------------------------------------

def _reduced_last(x: View, dims) -> tuple[View, tuple[int, ...]]:
    """``x`` with the dims ``dims`` (None or empty: all of them) moved to the end and merged into
    one last dim, and the shape of the dims kept (at least one: a full reduction keeps a dim
    of 1, which the caller's final reshape removes)."""
    if x.ndim == 0:  # a scalar's dim 0 / -1 (or all of its none): one row of one
        return x.then(("reshape", (1, 1))), (1,)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    red = sorted({_dim(d, x.ndim) for d in dims}) if dims else list(range(x.ndim))
    keep = [d for d in range(x.ndim) if d not in red]
    if red != list(range(x.ndim - len(red), x.ndim)):
        x = x.then(("permute", tuple(keep + red)))
    kept = tuple(x.shape[:len(keep)]) or (1,)
    if len(red) != 1 or not keep:
        x = x.then(("reshape", kept + (math.prod(x.shape[len(keep):]),)))
    return x, kept


def _reduce_to(L, fn: str, x: View, dims, dtype: torch.dtype | None = None) -> View:
    """``fn`` (mpk.ops.rows.REDUCE_FNS) of ``x`` over ``dims``, shaped as the node's result."""
    row, kept = _reduced_last(x, dims)
    out = L.emit("reduce", [row], {"fn": fn, "keepdim": False}, shape=kept,
                 dtype=L.meta().dtype if dtype is None else dtype)
    return out.then(("reshape", _shape(L)))


def _cast_for(L, x: View, dtype) -> View:
    """sum(dtype=...) / mean(dtype=...) reduce the converted values, as eager PyTorch does."""
    if dtype is None or dtype == L.graph.buffers[x.buffer].dtype:
        return x
    return _emit_pointwise(L, "cast", [x], shape=x.shape, dtype=dtype)


def _reduce(fn: str):
    def handler(L, node, x: View, dims=None, keepdim=False, *, dtype=None):
        return _reduce_to(L, fn, _cast_for(L, x, dtype), dims)
    return handler


# (the .default forms take no dims: all of them)
handles(aten.sum.dim_IntList, aten.sum.default)(_reduce("sum"))
handles(aten.mean.dim, aten.mean.default)(_reduce("mean"))
handles(aten.amax.default, aten.max.default)(_reduce("amax"))
handles(aten.amin.default, aten.min.default)(_reduce("amin"))


@handles(aten.argmax.default, aten.argmin.default)
def _arg_extreme(L, node, x: View, dim=None, keepdim=False):
    # dim=None: the index into the flattened tensor, which the merged row's index is
    return _reduce_to(L, node.target.overloadpacket.__name__, x, dim)


@handles(aten.max.dim, aten.min.dim)
def _extreme_dim(L, node, x: View, dim, keepdim=False):
    name = node.target.overloadpacket.__name__
    values_dtype, index_dtype = (v.dtype for v in node.meta["val"])
    return (_reduce_to(L, "a" + name, x, dim, values_dtype), _reduce_to(L, "arg" + name, x, dim, index_dtype))


@handles(aten.var.correction, aten.std.correction)
def _var(L, node, x: View, dims=None, *, correction=None, keepdim=False):
    """Two passes in float32, as eager: the mean, then the sum of squared deviations."""
    if not L.graph.buffers[x.buffer].dtype.is_floating_point:
        raise Unsupported("variance of an integer tensor")
    correction = 1 if correction is None else correction
    row, kept = _reduced_last(x, dims)
    f32 = torch.float32
    mean = L.emit("reduce", [row], {"fn": "mean", "keepdim": True}, shape=kept + (1,), dtype=f32)
    dev = _emit_pointwise(L, "sub", [row, mean], shape=row.shape, dtype=f32)
    sq = _emit_pointwise(L, "mul", [dev, dev], shape=row.shape, dtype=f32)
    total = L.emit("reduce", [sq], {"fn": "sum", "keepdim": False}, shape=kept, dtype=f32)
    std = node.target is aten.std.correction
    var = _emit_pointwise(L, "div", [total, max(0, row.shape[-1] - correction)], shape=kept,
                          dtype=f32 if std else None)
    return (_emit_pointwise(L, "sqrt", [var], shape=kept) if std else var).then(("reshape", _shape(L)))


@handles(aten.linalg_vector_norm.default)
def _vector_norm(L, node, x: View, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = _cast_for(L, x, dtype)
    f32 = torch.float32
    if ord == 2:
        sq = _emit_pointwise(L, "mul", [x, x], shape=x.shape, dtype=f32)
        return _emit_pointwise(L, "sqrt", [_reduce_to(L, "sum", sq, dim, f32)], shape=_shape(L))
    if ord in (1, math.inf, -math.inf):
        a = _emit_pointwise(L, "abs", [x], shape=x.shape)
        return _reduce_to(L, {1: "sum", math.inf: "amax", -math.inf: "amin"}[ord], a, dim)
    raise Unsupported(f"vector norm of order {ord}; 1, 2, inf and -inf are lowered")


def _row_op(L, kind: str, x: View, dim, attrs: dict | None = None) -> View:
    """A row op (over the last dim) over dim ``dim``: moved last and back (views, no copies)."""
    if x.ndim == 0:  # a scalar's dim 0 / -1: a row of one
        return L.emit(kind, [x.then(("reshape", (1,)))], attrs, shape=(1,)).then(("reshape", ()))
    d = _dim(dim, x.ndim)
    if d == x.ndim - 1:
        return L.emit(kind, [x], attrs)
    moved, inverse = _moved_last(x, d)
    return L.emit(kind, [moved], attrs, shape=moved.shape).then(("permute", inverse))


def _moved_last(x: View, d: int) -> tuple[View, tuple[int, ...]]:
    """x with dim d moved last (a view), and the permutation that moves it back."""
    perm = tuple(i for i in range(x.ndim) if i != d) + (d,)
    return x.then(("permute", perm)), tuple(perm.index(i) for i in range(x.ndim))


@handles(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def _softmax(L, node, x: View, dim, half_to_float=False, **kwargs):
    return _row_op(L, "softmax", x, dim, {"log": "log" in node.target.overloadpacket.__name__})


@handles(aten.cumsum.default)
def _cumsum(L, node, x: View, dim, *, dtype=None):
    return _row_op(L, "cumsum", _cast_for(L, x, dtype), dim)


def _sorted(L, x: View, dim, k: int, descending: bool) -> tuple[View, View]:
    """x's first k entries along ``dim`` in sorted order and their indices along it: a stable
    sort (equal values keep their order), NaN the largest value, as torch sorts. The indices are
    a ``sort`` op over rows (dim moved last, a view), the values a gather of them."""
    if x.ndim == 0:  # a scalar sorts as a row of one, and gives itself (torch: for k = 0 too)
        values, indices = _sorted(L, x.then(("reshape", (1,))), 0, 1, descending)
        return values.then(("reshape", ())), indices.then(("reshape", ()))
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    if not 0 <= k <= n:
        raise Unsupported(f"k={k} of a dim of {n} entries; expected 0 ≤ k ≤ {n}")
    if n > SORT_MAX and k > SORT_MAX:
        raise Unsupported(f"the first {k} of {n} entries in order: a row longer than {SORT_MAX} gives at most "
                          f"{SORT_MAX} (topk with k ≤ {SORT_MAX}; the GPU task keeps them in shared memory)")
    if n >= 2 ** 31:
        raise Unsupported(f"a sort over {n} entries; the GPU task counts positions in 32 bits")
    dtype = L.graph.buffers[x.buffer].dtype
    moved, inverse = _moved_last(x, d)
    shape = moved.shape[:-1] + (k,)
    if math.prod(shape) == 0:  # nothing to sort: empty results
        empty = [_emit_pointwise(L, "cast", [0], shape=shape, dtype=t) for t in (dtype, torch.int64)]
        return empty[0].then(("permute", inverse)), empty[1].then(("permute", inverse))
    indices = L.emit("sort", [moved], {"descending": bool(descending)}, shape=shape, dtype=torch.int64)
    values = L.emit("gather", [moved, indices], {"dim": x.ndim - 1, "wrap": False}, shape=shape, dtype=dtype)
    return values.then(("permute", inverse)), indices.then(("permute", inverse))


@handles(aten.sort.default, aten.sort.stable)
def _sort(L, node, x: View, dim=-1, descending=False, *, stable=None):
    return _sorted(L, x, dim, x.shape[_dim(dim, x.ndim)] if x.ndim else 1, descending)


@handles(aten.topk.default)
def _topk(L, node, x: View, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (aten's name)
    return _sorted(L, x, dim, int(k), largest)  # in order whether or not asked: torch allows it


@handles(aten.stack.default)
def _stack(L, node, tensors, dim=0):
    d = _dim(dim, tensors[0].ndim + 1)
    return L.emit("cat", [t.then(("reshape", t.shape[:d] + (1,) + t.shape[d:])) for t in tensors], {"dim": d})


@handles(aten.native_layer_norm.default, aten.layer_norm.default)
def _layer_norm(L, node, x: View, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    if len(normalized_shape) != 1:
        raise Unsupported(f"normalized_shape={list(normalized_shape)}; only the last dim is lowered")
    ins = [x] + [t for t in (weight, bias) if t is not None]
    out = L.emit("layer_norm", ins, {"eps": float(eps), "has_weight": weight is not None,
                                     "has_bias": bias is not None})
    if node.target is aten.native_layer_norm.default:
        return out, Unavailable("the mean output of layer_norm"), Unavailable("the rstd output of layer_norm")
    return out


@handles(aten.native_group_norm.default)
def _group_norm(L, node, x: View, weight, bias, N, C, HxW, group, eps):
    """A layer norm over each group's channels and positions, then the per-channel affine; the
    steps between stay in float32 and the last one rounds, as eager's one kernel does."""
    f32, out_dtype = torch.float32, L.meta().dtype
    rows = x.then(("reshape", (N, group, (C // group) * HxW)))
    y = L.emit("layer_norm", [rows], {"eps": float(eps), "has_weight": False, "has_bias": False},
               shape=rows.shape, dtype=f32 if weight is not None or bias is not None else out_dtype)
    y = y.then(("reshape", (N, C, HxW)))
    if weight is not None:
        y = _emit_pointwise(L, "mul", [y, weight.then(("reshape", (C, 1)))], shape=y.shape,
                            dtype=f32 if bias is not None else out_dtype)
    if bias is not None:
        y = _emit_pointwise(L, "add", [y, bias.then(("reshape", (C, 1)))], shape=y.shape, dtype=out_dtype)
    return (y.then(("reshape", x.shape)), Unavailable("the mean output of group_norm"),
            Unavailable("the rstd output of group_norm"))


@handles(mpk_ops.rms_norm.default)
def _rms_norm(L, node, x: View, weight, eps, compute_dtype, norm_dtype):
    ins = [x] + ([weight] if weight is not None else [])
    return L.emit("rms_norm", ins, {"eps": float(eps), "has_weight": weight is not None,
                                    "compute_dtype": str(compute_dtype)[6:],
                                    "norm_dtype": str(norm_dtype)[6:]})


@handles(mpk_ops.rms_norm_mm.default)
def _rms_norm_mm(L, node, x: View, weight: View, eps, compute_dtype, norm_dtype, b: View, silu=False):
    return L.emit("rms_matmul", [x, b, weight], {"eps": float(eps), "compute_dtype": str(compute_dtype)[6:],
                                                 "norm_dtype": str(norm_dtype)[6:], "silu": bool(silu)})


@handles(mpk_ops.mm_norm_stats.default)
def _mm_norm_stats(L, node, a: View, b: View, r: View, g: View, group=16):
    return L.emit("matmul_norm_stats", [a, b, r, g])  # the group size is the output's last dim


@handles(mpk_ops.norm_stats_mm.default)
def _norm_stats_mm(L, node, packed: View, b: View, eps, silu=False):
    _, M, groups, width = packed.shape
    hg, sums = (packed.then(("slice", 0, i, i + 1, 1)).then(("reshape", (M, groups * width))) for i in (1, 2))
    return L.emit("norm_stats_matmul", [hg, b, sums], {"eps": float(eps), "silu": bool(silu), "group": width})


@handles(mpk_ops.rope.default)
def _rope(L, node, x: View, cos: View, sin: View):
    if x.shape[-1] % 2:
        raise Unsupported(f"rotary embedding over an odd last dim ({x.shape[-1]})")
    return L.emit("rope", [x, cos, sin])


@handles(mpk_ops.silu_mul.default)
def _silu_mul(L, node, gate: View, up: View):
    return L.emit("silu_mul", [gate, up])


# --- linear algebra ------------------------------------------------------------------------

@handles(aten.mm.default, aten.bmm.default)
def _mm(L, node, a: View, b: View):
    return L.emit("matmul", [a, b])


@handles(mpk_ops.mm_silu_mul.default)
def _mm_silu_mul(L, node, x: View, b: View):
    return L.emit("matmul_silu", [x, b])


@handles(aten.addmm.default)
def _addmm(L, node, bias: View, a: View, b: View, *, beta=1, alpha=1):
    # beta = 0 ignores the bias, inf and NaN included (as torch.addmm does): not 0 · bias
    return L.emit("matmul", [a, b] + ([bias] if beta != 0 else []), {"alpha": alpha, "beta": beta})


@handles(aten.embedding.default)
def _embedding(L, node, weight: View, ids: View, *args):
    return L.emit("embedding", [weight, ids])


@handles(aten.cat.default)
def _cat(L, node, tensors, dim=0):
    # empty 1-d pieces join anything (torch.cat's legacy rule); all of them empty: an empty result
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    d = _dim(dim, tensors[0].ndim)
    return L.emit("cat", tensors, {"dim": d})


MAX_INDEX_TENSORS = 7  # codegen.MAX_INPUTS, less x


@handles(aten.gather.default)
def _gather(L, node, x: View, dim, index: View, sparse_grad=False):
    if x.ndim == 0:  # a scalar's dim 0: one entry
        return L.emit("gather", [x.then(("reshape", (1,))), index.then(("reshape", (1,)))], {"dim": 0, "wrap": False},
                      shape=(1,)).then(("reshape", ()))
    return L.emit("gather", [x, index], {"dim": _dim(dim, x.ndim), "wrap": False})


def _pick(L, x: View, d0: int, indices: list[View], wrap: bool, dtype: torch.dtype) -> View:
    """x with its dims d0 … d0+k-1 picked by the k integer ``indices``, which broadcast
    together: the result's dims are x's before d0, the indices' common shape, x's after."""
    common = tuple(torch.broadcast_shapes(*(i.shape for i in indices)))
    trail = x.shape[d0 + len(indices):]
    shape = x.shape[:d0] + common + trail
    if math.prod(shape) == 0:  # nothing picked: an empty result
        return _emit_pointwise(L, "cast", [0], shape=shape, dtype=dtype)
    spread = [i.then(("reshape", (1,) * (d0 + len(common) - i.ndim) + i.shape + (1,) * len(trail)))
              .then(("expand", shape)) for i in indices]
    return L.emit("gather", [x, *spread], {"dim": d0, "wrap": wrap}, shape=shape, dtype=dtype)


@handles(aten.index_select.default)
def _index_select(L, node, x: View, dim, index: View):
    if x.ndim == 0:
        x, index = x.then(("reshape", (1,))), index.then(("reshape", (1,)))
        return _pick(L, x, 0, [index], False, L.meta().dtype).then(("reshape", ()))
    return _pick(L, x, _dim(dim, x.ndim), [index.then(("reshape", (math.prod(index.shape),)))], False, L.meta().dtype)


@handles(aten.index.Tensor)
def _index(L, node, x: View, indices):
    """x[..., i, j, ...] with integer index tensors, which broadcast together; negative entries
    count from the end. Adjacent indexed dims keep their place in the result; indexed dims apart
    put the indices' shape first (torch's rule), here by moving those dims to the front."""
    given = [d for d, t in enumerate(indices) if t is not None]
    if not given:
        return _fresh(L, node, x)
    for d in given:
        dt = L.graph.buffers[indices[d].buffer].dtype
        if not _integral(dt) or dt == torch.bool:
            raise Unsupported("indexing by a bool mask (its result's size depends on the data)")
    if len(given) > MAX_INDEX_TENSORS:
        raise Unsupported(f"advanced indexing with {len(given)} index tensors; at most {MAX_INDEX_TENSORS}")
    d0 = given[0]
    if given != list(range(d0, d0 + len(given))):  # apart: the indexed dims to the front
        x = x.then(("permute", tuple(given) + tuple(d for d in range(x.ndim) if d not in given)))
        d0 = 0
    out = _pick(L, x, d0, [indices[d] for d in given], True, L.meta().dtype)
    if out.shape != _shape(L):
        raise Unsupported(f"advanced indexing gave {out.shape}, expected {_shape(L)}")
    return out


@handles(aten.constant_pad_nd.default)
def _constant_pad(L, node, x: View, pad, value=0):
    """Negative pads slice; positive ones cat blocks of the value, one dim at a time from the
    last (pad holds (left, right) pairs from the last dim backwards)."""
    padded = False
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if max(0, -lo) + max(0, -hi) > x.shape[d]:
            raise Unsupported(f"pad {list(pad)} cuts {max(0, -lo) + max(0, -hi)} of dim {d}'s {x.shape[d]} entries")
        x = _slice_view(x, d, max(0, -lo), x.shape[d] - max(0, -hi), 1)
        pieces = []
        for width in (max(0, lo), None, max(0, hi)):
            if width is None:
                pieces.append(x)
            elif width:
                fill_shape = x.shape[:d] + (width,) + x.shape[d + 1:]
                pieces.append(_emit_pointwise(L, "cast", [value], shape=fill_shape))
        if len(pieces) > 1:
            shape = x.shape[:d] + (sum(p.shape[d] for p in pieces),) + x.shape[d + 1:]
            x, padded = L.emit("cat", pieces, {"dim": d}, shape=shape, dtype=L.meta().dtype), True
    return x if padded else _fresh(L, node, x)  # nothing padded: a view, copied where the caller receives it


# --- attention ---------------------------------------------------------------------------

def _strip_head_repeat(v: View) -> View:
    """Undo HF ``repeat_kv`` (unsqueeze → expand → merge) so GQA reads the kv heads directly."""
    if len(v.steps) < 3 or [s[0] for s in v.steps[-3:]] != ["reshape", "expand", "reshape"]:
        return v
    before, unsqueezed, expanded, merged = ((v.base_shape,) + v.shapes)[-4:]
    if len(before) != 4:
        return v
    b, hkv, s, d = before
    rep = expanded[2]
    if unsqueezed != (b, hkv, 1, s, d) or expanded != (b, hkv, rep, s, d) or merged != (b, hkv * rep, s, d):
        return v
    return View(v.buffer, v.base_shape, v.steps[:-3], v.shapes[:-3])


def _attention(L, q: View, k: View, v: View, mask, dropout, causal, scale):
    if dropout:
        raise Unsupported(f"dropout_p={dropout} (inference only: expected 0)")
    if causal and mask is not None:
        raise Unsupported("both attn_mask and is_causal were given; expected one of them (or neither)")
    k, v = _strip_head_repeat(k), _strip_head_repeat(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise Unsupported(f"q/k/v of ranks {q.ndim}/{k.ndim}/{v.ndim}; expected [B, H, S, D] each")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise Unsupported(f"{q.shape[1]} query heads over {k.shape[1]} key / {v.shape[1]} value heads")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ins = [q, k, v] + ([mask] if mask is not None else [])
    out_shape = q.shape[:3] + (v.shape[-1],)
    return L.emit("attention", ins, {"causal": bool(causal), "scale": scale},
                  shape=out_shape, dtype=L.meta().dtype)


@handles(mpk_ops.attention.default)
def _mpk_attention(L, node, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return _attention(L, q, k, v, attn_mask, 0.0, is_causal, scale)


@handles(aten.scaled_dot_product_attention.default)
def _sdpa(L, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(L, q, k, v, attn_mask, dropout_p, is_causal, scale)


@handles(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(L, node, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    out = _attention(L, q, k, v, attn_mask, dropout_p, is_causal, scale)
    return out, Unavailable("the logsumexp output of attention")


@handles(aten._scaled_dot_product_flash_attention.default)
def _sdpa_flash(L, node, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out = _attention(L, q, k, v, None, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of flash attention") for _ in range(8))


@handles(aten._scaled_dot_product_efficient_attention.default)
def _sdpa_efficient(L, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out = _attention(L, q, k, v, attn_bias, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of efficient attention") for _ in range(3))


@handles(aten._scaled_dot_product_cudnn_attention.default)
def _sdpa_cudnn(L, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    out = _attention(L, q, k, v, attn_bias, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of cudnn attention") for _ in range(8))


# --- decode over the paged KV cache --------------------------------------------------------------

def _whole_input(L, v: View, what: str) -> View:
    """The identity view of a graph input: ops that write the paged cache in place need the
    caller's tensor itself (a view of it, or an intermediate, would lose the writes)."""
    buf = L.graph.buffers[v.buffer]
    if buf.role != "input":
        raise Unsupported(f"{what} must be a graph input passed whole (got {buf.name!r}, computed inside the graph)")
    if v.steps:
        raise Unsupported(f"{what} must be a graph input passed whole (got a view of {buf.name!r})")
    return v


@dataclass(frozen=True)
class DeferredRope:
    """A rope_append not emitted yet: its q feeds only a paged attention, which runs it inside
    its own tasks (rope_attn_partial)."""

    inputs: tuple
    attrs: dict
    shape: tuple[int, int, int]
    dtype: torch.dtype

    def emit(self, L) -> View:
        """The rope_append after all (the attention reads other tables than it did)."""
        return L.emit("rope_append", list(self.inputs), self.attrs, shape=self.shape, dtype=self.dtype)


MAX_FUSED_GROUP = 6  # cuda/mpk_tasks/paged_attention.cuh: the G q heads + k + v, one warp each


def _q_only_attended(node, layer: int, group: int) -> bool:
    """The q output of the rope_append ``node`` is read by exactly one paged attention, of the
    same layer, whose group fits the fused task."""
    q_nodes = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    users = [u for q in q_nodes for u in q.users]
    if len(q_nodes) != 1 or len(users) != 1 or users[0].target is not mpk_ops.paged_attention.default:
        return False
    attn = users[0]
    q_arg = attn.args[0] if attn.args else attn.kwargs.get("q")
    attn_layer = attn.args[5] if len(attn.args) > 5 else attn.kwargs.get("layer")
    return q_arg is q_nodes[0] and attn_layer == layer and group <= MAX_FUSED_GROUP


def _rope_append(L, node, qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, q_norm, k_norm,
                 layer, heads, kv_heads, eps):
    from mpk.frontend.fused_ops import rope_append_attrs

    cache_val = node.kwargs["_all_bases"][0].meta["val"]
    qkv_val = node.kwargs["qkv"].meta["val"]
    try:
        attrs = rope_append_attrs(qkv_val, cache_val, kv_indptr, kv_indices, kv_last_page_len, q_norm, k_norm, layer,
                                  heads, kv_heads, eps)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    ins = [qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, _whole_input(L, kv_cache, "kv_cache")]
    ins += [q_norm, k_norm] if q_norm is not None else []
    if (kv_cache.buffer, layer) in L.attended:
        raise Unsupported(f"rope_append writes layer {layer} of a cache that an earlier paged_attention of this "
                          "graph reads; append before attending")
    shape = (qkv.shape[0], heads, attrs["head_dim"])
    if L.fuse_rope_attention and _q_only_attended(node, layer, heads // kv_heads):
        q = DeferredRope(tuple(ins), attrs, shape, qkv_val.dtype)
        L.appended_q[(kv_cache.buffer, layer)] = q
    else:
        q = L.emit("rope_append", ins, attrs, shape=shape, dtype=qkv_val.dtype)
        L.appended_q[(kv_cache.buffer, layer)] = q.buffer
    return q, kv_cache  # the cache is written in place: its new value is the input buffer


MUTATING_OPS = {mpk_ops.rope_append.default: _rope_append}


@handles(torch.ops.higher_order.auto_functionalized_v2)
def _auto_functionalized(L, node, op, **kwargs):
    """A custom op that mutates its arguments, functionalized by AOTAutograd. mpk runs the
    mutation in place, so the functional 'new value' of each mutated base is the base itself."""
    if op not in MUTATING_OPS:
        raise Unsupported(f"{op} mutates its inputs and has no in-place lowering")
    bases = kwargs.pop("_all_bases")
    for key in [k for k in kwargs if k.startswith("_") and k.endswith("_base_index")]:
        kwargs[key[1:-len("_base_index")]] = bases[kwargs.pop(key)]
    views = sorted(k for k in kwargs if k.startswith("_"))
    if views:  # the op mutates a view of its base (slice/alias metadata): not lowered
        raise Unsupported(f"{op} mutates a view of its input ({views}); pass the whole cache tensor")
    out, *new_bases = MUTATING_OPS[op](L, node, **kwargs)
    return (out, *new_bases)


@handles(mpk_ops.paged_attention.default)
def _paged_attention(L, node, q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer, scale, num_splits):
    from mpk.frontend.fused_ops import default_splits, paged_attention_dims

    try:
        page_size, _, KV = paged_attention_dims(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer,
                                                num_splits)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    B, H, D = q.shape
    cache = _whole_input(L, kv_cache, "kv_cache")
    if isinstance(q, DeferredRope) and tuple(q.inputs[2:6]) != (kv_indptr, kv_indices, kv_last_page_len, cache):
        rope = q  # other page tables or another cache than the append's: the two stay apart
        q = rope.emit(L)
        L.appended_q[(rope.inputs[5].buffer, layer)] = q.buffer
    C = num_splits or default_splits(B, KV, kv_indices.shape[0] * page_size // max(1, B), L.num_workers)
    attrs = dict(layer=layer, scale=float(scale), page_size=page_size)
    # The cache is written in place by rope_append, invisibly to the dependency analysis; what
    # orders attention after the append is reading the q that same rope_append wrote (the tile
    # that appends kv head j also writes query head j·G, which every tile of kv head j reads).
    key = (cache.buffer, layer)
    # one chunk per sequence: ⊕ over one state is that state, so the tasks write the output
    # ([B, KV, G, D], viewed as [B, H, D]) and there is no merge op
    final = C == 1
    shape = (B, KV, H // KV, D) if final else (B, KV, C, H // KV, D + 1)
    dtype = L.meta().dtype if final else torch.float32
    attrs["final"] = final

    def merged(states: View) -> View:
        return states.then(("reshape", (B, H, D))) if final else \
            L.emit("attn_merge", [states], {}, shape=(B, H, D), dtype=L.meta().dtype)

    if isinstance(q, DeferredRope):  # the append runs inside the attention tasks
        L.attended.add(key)
        return merged(L.emit("rope_attn_partial", list(q.inputs), {**q.attrs, **attrs}, shape=shape, dtype=dtype))
    appended = L.appended_q.get(key)
    if appended is not None and (appended != q.buffer or q.steps):
        raise Unsupported(f"paged_attention over layer {layer} must read the q returned by that layer's "
                          "rope_append (which appends the step's k/v); nothing else orders it after the append")
    L.attended.add(key)
    return merged(L.emit("attn_partial", [q, cache, kv_indptr, kv_indices, kv_last_page_len], attrs, shape=shape,
                         dtype=dtype))
