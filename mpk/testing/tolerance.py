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


def attention_bound(dtype: torch.dtype, head_dim: int, positions: int, p_rounded: bool | None = None) -> float:
    """The bound on ``relative_error`` of attention over at most ``positions`` cached rows in
    ``dtype`` against float64 from the same inputs: the output's rounding, P's when
    ``p_rounded`` (the tensor cores take P·V in ``dtype``; None: for 16-bit dtypes), and the D-
    and n-term fp32 sums (module docstring)."""
    rounded = dtype.itemsize == 2 if p_rounded is None else p_rounded
    return rounding_bound(dtype, 1 + rounded, k=head_dim + positions)


def decoder_roundings(cfg, positions: int) -> tuple[float, int]:
    """(gains, k) of a ``DecoderLM``'s logits at a token that attends ``positions`` cache
    positions, for ``rounding_bound``: along the way, per layer, the input RMSNorm (a sum over
    hidden, 2 roundings), the qkv projection (hidden terms, 1), Qwen3's qk-norm (head_dim, 2),
    RoPE (its table and the rotated value, 2), scores (head_dim, 1), softmax (exp and the
    division, 2; a sum over positions), P·V (positions, 1), the o projection (heads · head_dim,
    1), the residual add (1), the post-attention RMSNorm (hidden, 2), gate·up (hidden, 1),
    SiLU·mul (gains SILU_GAIN + 1), down (inter, 1) and the residual add (1); then the final
    RMSNorm (hidden, 2) and the LM head (hidden, 1). First order: each rounding reaches the
    logits with the gain counted here, i.e. the layers after it do not amplify it beyond
    max |logit| (which random models of weight std ≤ 0.1 meet with a wide margin: measured
    errors stay two orders below the bound)."""
    qk = cfg.head_dim if cfg.qk_norm else 0
    k_layer = 3 * cfg.hidden + qk + cfg.head_dim + 2 * positions + cfg.heads * cfg.head_dim + cfg.hidden + cfg.inter
    g_layer = 2 + 1 + (2 if cfg.qk_norm else 0) + 2 + 1 + 2 + 1 + 1 + 1 + 2 + 1 + (SILU_GAIN + 1) + 1 + 1
    return cfg.layers * g_layer + 3, cfg.layers * k_layer + 2 * cfg.hidden


def decoder_logits_bound(cfg, positions: int, dtype: torch.dtype) -> float:
    """The bound on ``relative_error`` between two implementations of a ``DecoderLM``'s logits
    (mpk's and transformers', or two schedules of mpk's), each computed in ``dtype`` with fp32
    accumulation: twice ``rounding_bound`` of ``decoder_roundings`` (each implementation within
    it of the exact logits)."""
    gains, k = decoder_roundings(cfg, positions)
    return 2 * rounding_bound(dtype, [gains], k)
