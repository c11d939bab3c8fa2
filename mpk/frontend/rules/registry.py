"""The rule table: ``HANDLERS`` maps an ATen overload (or a whole overload packet) to a function
``(lowering, node, *args, **kwargs) -> value``; tensors arrive as ``View``s. A rule raises
``Unsupported`` with the reason when an argument combination is outside what it lowers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)

if TYPE_CHECKING:
    from mpk.frontend.values import Lowering

from mpk.ir.views import View

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


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def node_shape(L: Lowering) -> tuple[int, ...]:
    return tuple(int(s) for s in L.meta().shape)


def slice_view(x: View, dim: int, start, end, step: int) -> View:
    n = x.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = max(0, min(start, n)), max(0, min(end, n))
    end = max(end, start)
    return x.then(("slice", dim, start, end, step))
