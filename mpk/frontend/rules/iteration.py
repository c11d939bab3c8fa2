"""The rule for ``mpk.decode_advance`` (the start-of-iteration task, mpk.ops.iteration): one
``decode_advance`` op writing its state inputs in place."""

from __future__ import annotations

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.paged import MUTATING_OPS, _whole_input
from mpk.ir.views import View

STATE = ("tokens", "kv_indptr", "kv_indices", "kv_last_page_len", "seqs", "pool", "out")


def _decode_advance(L, node, next_tokens: View, page_size: int, max_len: int, stops: int, **state: View) -> View:
    # (shapes and dtypes were checked by the op's fake implementation when the graph was traced)
    ins = [next_tokens] + [_whole_input(L, state[name], name) for name in STATE]
    return L.emit("decode_advance", ins, dict(page_size=page_size, max_len=max_len, stops=stops),
                  shape=tuple(next_tokens.shape), dtype=torch.int64)


MUTATING_OPS[torch.ops.mpk.decode_advance.default] = _decode_advance
