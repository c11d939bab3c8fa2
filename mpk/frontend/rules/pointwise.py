"""Rules for elementwise ops (one ``pointwise`` op per ATen op, its function and operands as
attrs, computed in the dtype torch promotes to) and tensors made inside forward (fills, counts)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles, node_shape, norm_dim, slice_view
from mpk.frontend.values import ScalarConst, Unavailable, Unsupported
from mpk.ir.views import View
from mpk.ops.pointwise import INT_FNS

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


def is_integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def emit_pointwise(L, fn: str, args, shape=None, dtype: torch.dtype | None = None, extra: float | None = None) -> View:
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
    if is_integral(out_dtype) and fn in ("cast", "where"):
        # a fill value (full, fill_, masked_fill) is converted to the tensor's integer dtype first
        spec = [["c", _converted(c, out_dtype, True)] if kind == "c" else [kind, c] for kind, c in spec]
    exact_int = (is_integral(out_dtype) and all(is_integral(L.graph.buffers[v.buffer].dtype) for v in inputs)
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
                  else emit_pointwise(L, "cast", [v], shape=v.shape, dtype=compute) for v in inputs]
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
        return emit_pointwise(L, fn, args)
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
    return emit_pointwise(L, fn, args)


@handles(aten.scalar_tensor.default)
def _scalar_tensor(L, node, value, **kwargs):
    return ScalarConst(f"a tensor made inside forward from the number {value} (torch.tensor / scalar_tensor): pass "
                       "it as an input or register it as a buffer", value)


# --- tensors made inside forward: a fill or a count, computed by the kernel -----------------------

@handles(aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill.Scalar, aten.fill.Tensor)
@_elementwise
def _fill(L, node, *args, **kwargs):
    return emit_pointwise(L, "cast", [args[-1]])  # the fill value comes last (after a size or a tensor)


@handles(aten.zeros.default, aten.ones.default, aten.zeros_like.default, aten.ones_like.default,
         aten.empty.memory_format, aten.empty_like.default, aten.new_zeros.default, aten.new_ones.default,
         aten.new_empty.default)
def _zeros_ones(L, node, *args, **kwargs):
    # an empty tensor's elements are whatever: zeros (functionalization has turned the in-place
    # ops that fill it into ops that read it)
    return emit_pointwise(L, "cast", [int("ones" in node.target.overloadpacket.__name__)])


@handles(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(L, node, *args, **kwargs):
    start, _, step = (0, *args, 1) if len(args) == 1 else (*args, 1)[:3]
    if is_integral(L.meta().dtype):  # torch counts from the truncated start by the truncated step
        start, step = int(start), int(step)
    return emit_pointwise(L, "arange", [start, step])


@handles(aten.rsub.Scalar, aten.rsub.Tensor)
@_elementwise
def _rsub(L, node, x, other, alpha=1):
    return _pointwise("sub")(L, node, other, x, alpha=alpha)


@handles(aten.gelu.default)
def _gelu(L, node, x: View, approximate="none"):
    fn = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if fn is None:
        raise Unsupported(f"approximate={approximate!r}, expected 'none' or 'tanh'")
    return emit_pointwise(L, fn, [x])


@handles(aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default)
@_elementwise
def _clamp(L, node, x, lo=None, hi=None):
    if node.target is aten.hardtanh.default:
        lo = -1.0 if lo is None else lo
        hi = 1.0 if hi is None else hi
    if lo is None and hi is None:
        raise Unsupported("clamp with neither min nor max")
    if lo is None or hi is None:
        return emit_pointwise(L, "maximum" if hi is None else "minimum", [x, hi if lo is None else lo])
    return emit_pointwise(L, "clamp", [x, lo, hi])


@handles(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
@_elementwise
def _masked_fill(L, node, x, mask, value):
    return emit_pointwise(L, "where", [mask, value, x])


@handles(aten.leaky_relu.default)
def _leaky_relu(L, node, x: View, negative_slope=0.01):
    return emit_pointwise(L, "leaky_relu", [x, negative_slope])


@handles(aten._prelu_kernel.default)
def _prelu(L, node, x: View, weight: View):
    return emit_pointwise(L, "leaky_relu", [x, weight])  # the slope a tensor broadcast over x


@handles(aten.elu.default)
def _elu(L, node, x: View, alpha=1.0, scale=1, input_scale=1):
    return emit_pointwise(L, "elu", [x, alpha, scale], extra=input_scale)


@handles(aten.celu.default)
def _celu(L, node, x: View, alpha=1.0):
    return emit_pointwise(L, "elu", [x, alpha, 1.0], extra=1.0 / alpha)


@handles(aten.threshold.default)
def _threshold(L, node, x: View, threshold, value):
    return emit_pointwise(L, "threshold", [x, threshold, value])


@handles(aten.log_sigmoid_forward.default)
def _log_sigmoid(L, node, x: View):
    return emit_pointwise(L, "log_sigmoid", [x]), Unavailable("the buffer output of log_sigmoid_forward")


@handles(aten.glu.default)
def _glu(L, node, x: View, dim=-1):
    d = norm_dim(dim, x.ndim)
    half = x.shape[d] // 2
    return emit_pointwise(L, "glu", [slice_view(x, d, 0, half, 1), slice_view(x, d, half, 2 * half, 1)])


@handles(aten.pixel_shuffle.default)
def _pixel_shuffle(L, node, x: View, r: int):
    *lead, c, h, w = x.shape
    n = len(lead)
    split = x.then(("reshape", (*lead, c // (r * r), r, r, h, w)))
    moved = split.then(("permute", (*range(n), n, n + 3, n + 1, n + 4, n + 2)))
    return moved.then(("reshape", node_shape(L)))


@handles(aten.softplus.default)
def _softplus(L, node, x: View, beta=1, threshold=20):
    return emit_pointwise(L, "softplus", [x, beta, threshold])
