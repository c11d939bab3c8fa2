"""The rule for ``mpk.sample``: a ``sample_partial`` op, a ``sample_digit`` op per further radix
level (1 for bf16/f16 logits, 3 for float32; each repeats the previous one's histograms) and a
``sample`` op reading the partials and the last of them
(mpk.ops.sampling)."""

from __future__ import annotations

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles
from mpk.ir.views import View
from mpk.ops.sampling import DIGIT_FIELDS, PARTIAL_FIELDS, digit_levels, segments

mpk_ops = torch.ops.mpk


@handles(mpk_ops.sample.default)
def _sample(L, node, logits: View, temperature: View, top_k: View, top_p: View, min_p: View, seed: View,
            counter: View):
    # (the fake tensors were checked by the op's fake implementation when the graph was traced)
    B, V = logits.shape
    S = segments(V)
    partials = L.emit("sample_partial", [logits, temperature], {}, shape=(B, S, PARTIAL_FIELDS), dtype=torch.int64)
    filters = [logits, temperature, top_k, top_p, min_p, partials]
    hists = []  # the last sample_digit op's output: every level after the first
    for level in range(2, digit_levels(L.graph.buffers[logits.buffer].dtype) + 1):
        hists = [L.emit("sample_digit", filters + hists, {"level": level}, shape=(B, S, (level - 1) * DIGIT_FIELDS),
                        dtype=torch.int64)]
    return L.emit("sample", [logits, temperature, top_k, top_p, min_p, seed, counter, partials] + hists, {},
                  shape=(B,), dtype=torch.int64)
