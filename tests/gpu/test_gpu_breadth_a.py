"""tril, baddbmm and friends on the GPU (marker ``gpu``; skipped without CUDA): tril / triu (the
``triangle`` task), baddbmm / addbmm (the matmul task's alpha·a @ b + beta·bias), repeat and a
tensor constant made in forward, in one persistent kernel against eager PyTorch.

Element moves are exact; a float32 matmul is within ``rounding_bound`` of a float64 reference
(its roundings and the K-term fp32 sum)."""

from __future__ import annotations

import pytest
import torch

from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import rounding_bound

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _new_ops(x, bias, a, w, s):
    return (torch.tril(x, -1), torch.triu(x.to(torch.bfloat16), 2), torch.ones(x.shape[-1], x.shape[-1],
                                                                              dtype=torch.bool, device=x.device).tril() & s,
            x.repeat(2, 3) * torch.tensor([1.0, 2.0, 3.0, 4.0] * 3, device=x.device),
            torch.baddbmm(bias, a, w, beta=0.5, alpha=2.0), torch.addbmm(bias[0], a, w))


@pytest.mark.parametrize("rows,k", [(6, 7), (70, 33)])
def test_new_tasks_match_eager(rows, k):
    x = torch.randn(rows, 4, device=DEV)
    x.view(-1)[::5] = float("nan")  # outside the triangle a NaN becomes 0
    bias, a, w = (torch.randn(3, 4, 5, device=DEV), torch.randn(3, 4, k, device=DEV), torch.randn(3, k, 5, device=DEV))
    s = torch.rand(4, 4, device=DEV) > 0.5
    with torch.no_grad():
        out = torch.compile(_new_ops, backend="mpk", options={"executor": "gpu", "fallback": "error"})(x, bias, a, w, s)
    ref = _new_ops(x, bias, a, w, s)
    for o, r in zip(out[:4], ref[:4]):
        torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=True)
    a64, w64 = a.double(), w.double()
    baddbmm = 2.0 * (a64 @ w64) + 0.5 * bias.double()
    addbmm = (a64 @ w64).sum(0) + bias[0].double()
    assert relative_error(out[4].double(), baddbmm) <= rounding_bound(torch.float32, 3, k=k)
    assert relative_error(out[5].double(), addbmm) <= rounding_bound(torch.float32, 3, k=3 * k)
