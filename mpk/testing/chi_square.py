"""Chi-square goodness of fit for the samplers' tests (CPU and GPU): the survival function and
the p-value of observed draws against a distribution."""

from __future__ import annotations

import math

import torch

# Reject a sampler when the chi-square statistic has a p-value below this: a correct sampler
# fails one run in 10,000.
CHI2_ALPHA = 1e-4


def chi2_sf(x: float, dof: int) -> float:
    """The chi-square survival function (scipy's where installed, else the regularized upper
    incomplete gamma Q(dof/2, x/2) by its series / continued fraction)."""
    try:
        from scipy.stats import chi2
        return float(chi2.sf(x, dof))
    except ImportError:
        pass
    a, z = dof / 2, x / 2
    if z < a + 1:  # P by its series, Q = 1 − P
        term = total = 1 / a
        n = 1
        while abs(term) > 1e-15 * abs(total):
            term *= z / (a + n)
            total += term
            n += 1
        return 1 - total * math.exp(-z + a * math.log(z) - math.lgamma(a))
    b, c, d = z + 1 - a, 1 / 1e-300, 1 / (z + 1 - a)  # Lentz's continued fraction for Q
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` drawn from ``probs`` (over the tokens with probability > 0)."""
    keep = probs > 0
    n = int(counts.sum())
    expected = n * probs[keep].double()
    stat = float(((counts[keep].double() - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)
