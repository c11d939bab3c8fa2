"""Error bounds for GPU results against float64 references, derived from the roundings a task
performs instead of picked by hand.

The tests measure ``relative_error(out, ref) = max|out − ref| / max|ref|``. A first-order bound
of it adds, over the roundings on an output element's way:

* a rounding to a floating dtype of unit roundoff u (round to nearest: |fl(v) − v| ≤ u·|v|)
  of a value v: at most u·|v| ≤ u·max|ref| (v within first order of the element or of one of
  the operands it is linear in), so u — times the gain g of what follows: a product's factor
  passes its relative error on with gain 1, silu(x) with gain |x·silu'(x)/silu(x)| ≤ 1.28 on
  x ≥ 0 (where the largest values of a gate lie; for x < 0, |x·silu'(x)| < 0.22 while
  |silu(x)| < 0.28, so relative to the largest value the gain there is smaller);
* operands rounded before a dot product of K terms: their errors δᵢ·xᵢwᵢ (|δᵢ| ≤ u) have no
  common sign, so they add like a random walk, ≈ u·(Σ(xᵢwᵢ)²)^½ ≈ u·rms(result) ≤ u·max|ref|:
  one rounding each rounded operand;
* the K-term sum itself in the accumulator dtype (fp32, u = 2^-24): at most (K − 1)·u_acc
  relative to the sum of |terms|, counted as K·u_acc (its random-walk size, √K·u_acc, is far
  smaller; only a sum that cancels heavily exceeds it, which the tests' random data does not).

* a rotation (RoPE: x·cos + rotate_half(x)·sin) mixes two elements of a pair, each error
  passing with gain |cos| or |sin|: gain ≤ |cos| + |sin| ≤ √2 (``ROPE_GAIN``);
* attention (``attention_bound``): the scores are D-term dot products and the softmax's sum an
  n-term one (K = D + n in fp32); the output is a convex combination of v rows, so its rounding
  counts once, and a tensor-core P·V rounds P to the 16-bit dtype first (once more, gain 1:
  its errors δⱼpⱼvⱼ add like a dot product's).

``rounding_bound(dtype, gains, k)`` = u(dtype)·Σ gains + K·u(acc). It is a bound, not an
estimate: each rounding error can reach its maximum, and on ~10^5 elements some element comes
close to the sum of them.
"""

from __future__ import annotations

from typing import Iterable

import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}
SILU_GAIN = 1.28  # max over x ≥ 0 of x·silu'(x)/silu(x) = 1 + x·(1 − σ(x)) (at x ≈ 1.28)
ROPE_GAIN = 2 ** 0.5  # max of |cos θ| + |sin θ|


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating dtype: half the spacing of its values in [1, 2) (2^-p, p bits of precision)."""
    return UNIT_ROUNDOFF[dtype]


def rounding_bound(dtype: torch.dtype, gains: float | Iterable[float] = 1, k: int = 0,
                   acc: torch.dtype = torch.float32) -> float:
    """The bound on ``relative_error`` of a result whose way holds roundings to ``dtype`` with
    the given gains (a number: their sum, n for n roundings of gain 1) and a ``k``-term sum in ``acc`` (module
    docstring: the derivation)."""
    total = float(gains) if isinstance(gains, (int, float)) else float(sum(gains))
    return unit_roundoff(dtype) * total + k * unit_roundoff(acc)


def attention_bound(dtype: torch.dtype, head_dim: int, positions: int) -> float:
    """The bound on ``relative_error`` of attention over at most ``positions`` cached rows in
    ``dtype`` against float64 from the same inputs: the output's rounding, P's (16-bit dtypes,
    where the tensor cores take P·V), and the D- and n-term fp32 sums (module docstring)."""
    return rounding_bound(dtype, 1 + (dtype.itemsize == 2), k=head_dim + positions)
