"""Elementwise op kinds: ``pointwise`` (one function of tensors and constants), ``silu_mul``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.errors import CompileError
from mpk.ops.gpu import GpuSpec, OpInfo, Params, all_inputs, float_bits
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register

def _relu6_plus3(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x + 3, 0, 6)


# fn name -> (arity, implementation). Constants are passed as Python scalars, and attrs['extra']
# (a constant of the function, not an operand: elu's input scale) after the operands. The order
# is the CUDA task's function ids (cuda/mpk_tasks/pointwise.cuh: PointwiseFn).
POINTWISE_FNS = {
    "add": (2, torch.add),
    "sub": (2, torch.sub),
    "mul": (2, torch.mul),
    "div": (2, torch.div),
    "pow": (2, torch.pow),
    "neg": (1, torch.neg),
    "exp": (1, torch.exp),
    "rsqrt": (1, torch.rsqrt),
    "sqrt": (1, torch.sqrt),
    "silu": (1, F.silu),
    "gelu": (1, F.gelu),
    "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh")),
    "sigmoid": (1, torch.sigmoid),
    "tanh": (1, torch.tanh),
    "relu": (1, torch.relu),
    "cast": (1, lambda x: x),  # the output cast does the work
    "abs": (1, torch.abs),
    "log": (1, torch.log),
    "sin": (1, torch.sin),
    "cos": (1, torch.cos),
    "reciprocal": (1, torch.reciprocal),
    "erf": (1, torch.erf),
    "log1p": (1, torch.log1p),
    "expm1": (1, torch.expm1),
    "floor": (1, torch.floor),
    "ceil": (1, torch.ceil),
    "round": (1, torch.round),
    "trunc": (1, torch.trunc),
    "sign": (1, torch.sign),
    "maximum": (2, torch.maximum),
    "minimum": (2, torch.minimum),
    "clamp": (3, lambda x, lo, hi: torch.minimum(torch.maximum(x, lo), hi)),
    "eq": (2, torch.eq),
    "ne": (2, torch.ne),
    "lt": (2, torch.lt),
    "le": (2, torch.le),
    "gt": (2, torch.gt),
    "ge": (2, torch.ge),
    "where": (3, torch.where),
    "logical_and": (2, torch.logical_and),
    "logical_or": (2, torch.logical_or),
    "logical_xor": (2, torch.logical_xor),
    "logical_not": (1, torch.logical_not),
    "bitwise_and": (2, torch.bitwise_and),
    "bitwise_or": (2, torch.bitwise_or),
    "bitwise_xor": (2, torch.bitwise_xor),
    "bitwise_not": (1, torch.bitwise_not),
    "leaky_relu": (2, lambda x, slope: torch.where(x > 0, x, x * slope)),  # a tensor slope: prelu
    "elu": (3, lambda x, alpha, scale, input_scale: torch.ops.aten.elu(x, alpha, scale, input_scale)),
    "softplus": (3, lambda x, beta, threshold: F.softplus(x, beta, threshold)),
    "hardsigmoid": (1, lambda x: _relu6_plus3(x) / 6),
    "hardswish": (1, lambda x: x * _relu6_plus3(x) / 6),
    "mish": (1, F.mish),
    "glu": (2, lambda a, b: a * torch.sigmoid(b)),
    "log_sigmoid": (1, F.logsigmoid),
    "threshold": (3, F.threshold),
    "arange": (2, None),  # start + step · i along the 1-d output (torch.arange): _pointwise_cpu
}

# Functions with an exact 64-bit integer form in the CUDA task (apply_pointwise<long long>): an op
# whose result and operands are all integers or bools runs there, as eager PyTorch computes it.
INT_FNS = frozenset({
    "add", "sub", "mul", "pow", "neg", "relu", "cast", "abs", "floor", "ceil", "round", "trunc", "sign",
    "maximum", "minimum", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "where", "logical_and", "logical_or",
    "logical_xor", "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "arange",
})


# --- the CUDA side (cuda/mpk_tasks/pointwise.cuh) -----------------------------------------------

_FN_IDS = {name: i for i, name in enumerate(POINTWISE_FNS)}
_POINTWISE_FORMS = {None: "float", "int": "long long", "f64": "double"}  # attrs['form'] -> the element type


def _pointwise_params(op: OpInfo) -> Params:
    """iparam[0..2]: each operand's input index (-1: a constant), [3] the arity | the function
    << 8, [4] the function's extra constant's float64 bits (attrs['extra']: elu's input scale),
    [5..7] the constants of the integer form (their values) and of the float64 form (their
    bits); fparam[0..2] the float form's constants. The form is the instantiation."""
    a = op.attrs
    args = a["args"]
    if len(args) > 3:
        raise CompileError(f"pointwise {a['fn']} with {len(args)} operands; the CUDA task takes at most 3")
    ip, fp = [0] * 8, [0.0] * 4
    form = a.get("form")
    for j, (kind, val) in enumerate(args):
        if kind == "in":
            ip[j] = val
        else:
            ip[j] = -1
            if form == "int":
                ip[5 + j] = int(val)
            elif form == "f64":
                ip[5 + j] = float_bits(val)
            else:
                fp[j] = float(val)
    ip[3], ip[4] = len(args) | _FN_IDS[a["fn"]] << 8, float_bits(a.get("extra", 0.0))
    return ip, fp


def silu_mul_fast(op: OpInfo) -> bool:
    """The 16-byte-vector bf16 silu_mul of pointwise.cuh (variant 1) for 2-d bf16 gate, up and
    output of the output's shape, unit stride along the last dim, offsets and row strides
    multiples of 8 elements and tile column bounds multiples of 8."""
    if op.ndim != 2:
        return False
    M, N = op.out_shape
    for v in op.inputs:
        if (v.ndim != 2 or list(v.shape) != [M, N] or v.strides[1] != 1 or v.dtype != torch.bfloat16 or v.offset % 8
                or (M > 1 and v.strides[0] % 8)):
            return False
    g = op.grid[1]
    return op.out_dtype == torch.bfloat16 and all((i * N // g) % 8 == 0 for i in range(g + 1))


def _pointwise_task(op: OpInfo) -> str:
    return f"mpk::pointwise_tile<{_POINTWISE_FORMS[op.attrs.get('form')]}>"


# the float64 form keeps float64 exact
POINTWISE_GPU = GpuSpec(params=_pointwise_params, task=_pointwise_task, float64_exact=True)
SILU_MUL_GPU = GpuSpec(variant=lambda op: int(silu_mul_fast(op)),
                       vector_inputs=lambda op: all_inputs(op) if silu_mul_fast(op) else ())


def _pointwise_regions(sig: OpSig, rect):
    return [broadcast_region(s, sig.out_shape, rect) for s in sig.in_shapes]


def _pointwise_cpu(sig: OpSig, rect, xs):
    operands = [xs[a[1]] if a[0] == "in" else a[1] for a in sig.attrs["args"]]
    fn = sig.attrs["fn"]
    shape = tuple(hi - lo for lo, hi in rect)
    if fn == "arange":
        start, step = operands
        (lo, hi), = rect
        return (start + step * torch.arange(lo, hi, dtype=torch.float64 if sig.out_dtype.is_floating_point
                                            else torch.int64)).to(sig.out_dtype)
    if not xs:  # a constant (torch.full / zeros / ones)
        return torch.full(shape, operands[0], dtype=sig.out_dtype)
    tensors = [o for j, o in enumerate(operands) if isinstance(o, torch.Tensor) and not (fn == "where" and j == 0)]
    like = (tensors or [xs[0]])[0]
    for j, o in enumerate(operands):
        # torch functions want a tensor first (rsub); these take no numbers (clamp's and where's
        # would do, but not in a mix with tensors; logical_and not at all)
        if not isinstance(o, torch.Tensor) and (j == 0 or fn in ("clamp", "where", "maximum", "minimum")
                                                or fn.startswith("logical_")):
            operands[j] = torch.tensor(o, dtype=torch.result_type(o, like))
    extra = [sig.attrs["extra"]] if "extra" in sig.attrs else []
    # inputs all broadcast (a fill from a 0-d tensor) give less than the tile
    return POINTWISE_FNS[fn][1](*operands, *extra).to(sig.out_dtype).expand(shape)


register(OpDef(
    kind="pointwise", type_id=1, input_regions=_pointwise_regions, cpu=_pointwise_cpu, gpu=POINTWISE_GPU,
    doc="out = fn(args…); args are ['in', i] (tensor input i, broadcast) or ['c', value]; with no tensor "
        "operand, 'cast' of a constant fills the output and 'arange' counts",
))


def _silu_mul_cpu(sig: OpSig, rect, xs):
    return (F.silu(xs[0]) * xs[1]).to(sig.out_dtype)


register(OpDef(
    kind="silu_mul", type_id=2, input_regions=_pointwise_regions, cpu=_silu_mul_cpu, gpu=SILU_MUL_GPU,
    doc="out = silu(a) * b (the gate·up product of SwiGLU MLPs)",
))
