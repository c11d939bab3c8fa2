"""The rule for ``mpk.sample``: a ``sample_partial`` op (each (row, segment) tile's max and argmax)
and a ``sample`` op reading its partials (a task per row; mpk.ops.sampling)."""

from __future__ import annotations

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles
from mpk.ir.views import View
from mpk.ops.sampling import segments

mpk_ops = torch.ops.mpk


@handles(mpk_ops.sample.default)
def _sample(L, node, logits: View, temperature: View, top_k: View, top_p: View, min_p: View, seed: View,
            counter: View):
    # (the fake tensors were checked by the op's fake implementation when the graph was traced)
    B, V = logits.shape
    partials = L.emit("sample_partial", [logits], {}, shape=(B, segments(V), 2), dtype=torch.float32)
    return L.emit("sample", [logits, temperature, top_k, top_p, min_p, seed, counter, partials], {},
                  shape=(B,), dtype=torch.int64)
