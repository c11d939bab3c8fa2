"""Elementwise op kinds: ``pointwise`` (one function of tensors and constants), ``silu_mul``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.ops.registry import OpDef, OpSig, broadcast_region, register

# fn name -> (arity, implementation). Constants are passed as Python scalars.
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
}


def _pointwise_regions(sig: OpSig, rect):
    return [broadcast_region(s, sig.out_shape, rect) for s in sig.in_shapes]


def _pointwise_cpu(sig: OpSig, rect, xs):
    operands = [xs[a[1]] if a[0] == "in" else a[1] for a in sig.attrs["args"]]
    if not isinstance(operands[0], torch.Tensor):  # e.g. rsub: torch functions want a tensor first
        like = next(o for o in operands if isinstance(o, torch.Tensor))
        operands[0] = torch.tensor(operands[0], dtype=torch.result_type(operands[0], like))
    return POINTWISE_FNS[sig.attrs["fn"]][1](*operands).to(sig.out_dtype)


register(OpDef(
    kind="pointwise", type_id=1, input_regions=_pointwise_regions, cpu=_pointwise_cpu,
    doc="out = fn(args…); args are ['in', i] (tensor input i, broadcast) or ['c', value]",
))


def _silu_mul_cpu(sig: OpSig, rect, xs):
    return (F.silu(xs[0]) * xs[1]).to(sig.out_dtype)


register(OpDef(
    kind="silu_mul", type_id=2, input_regions=_pointwise_regions, cpu=_silu_mul_cpu,
    doc="out = silu(a) * b (the gate·up product of SwiGLU MLPs)",
))
