"""The rule for ``mpk.sample``: one ``sample`` op (mpk.ops.sampling), a task per row of logits."""

from __future__ import annotations

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles
from mpk.ir.views import View

mpk_ops = torch.ops.mpk


@handles(mpk_ops.sample.default)
def _sample(L, node, logits: View, temperature: View, top_k: View, top_p: View, min_p: View, seed: View,
            counter: View):
    # (the fake tensors were checked by the op's fake implementation when the graph was traced)
    return L.emit("sample", [logits, temperature, top_k, top_p, min_p, seed, counter], {},
                  shape=(logits.shape[0],), dtype=torch.int64)
