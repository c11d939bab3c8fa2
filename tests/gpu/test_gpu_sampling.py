"""Sampling on the GPU (marker ``gpu``; skipped without CUDA): the ``sample_partial``,
``sample_digit`` and ``sample`` tasks (cuda/mpk_tasks/sampling.cuh) on Qwen3's vocabulary of
151,936 against the reference semantics (mpk.engine.sampling) for batches of 1, 16 and 64 rows
and every parameter mix, token for token; and their draws' distribution (chi-square).

Greedy rows must equal torch.argmax exactly. A sampled row must equal the reference's token
unless float rounding decides it. The reference is evaluated in float64 (``reference64``), and
each row's rounding window is derived from the tasks' own errors (``mass_error``): a token's
mass is round(e·2^40) in its segment's unit 2^E_s (E_s = ⌈segmax·scale⌉) with
e = exp2f(fmaf(x, scale, −E_s)), so its relative error is at most exp2f's 2 ulp (2^-22) plus
ln 2 · 2^-24 · (2|a| + 1), a = (x − max)·log2(e)/T: the fma's one rounding of an argument of at
most |a| + 1, and scale's rounding, which tempers every token by the same factor (|a| relative
to the max). In units of p_max (whose mass is over half the row's unit 2^E_row) the fixed point
adds at most 2^-40 a token, and a segment's sum shifted into the row's unit loses under 2^-39.
A CDF value C_j = Σ_{i≤j} m_i / W is then off by at most twice the mass-weighted relative error
plus ((n + 1)·2^-40 + S·2^-39) / W (W: the kept mass, n: the kept tokens, S: the segments);
that is the row's window ``w``.

A row is a draw tie when the uniform lies within ``w`` of a CDF step of the token drawn: its
token must be a kept id whose CDF step comes within ``w`` of the uniform (the reference's, a
neighbour, or several ids on where tokens' masses are below ``w``). Ties are expected: a row over
the whole vocabulary has CDF steps of ~1e-5, not far above ``w`` (~1e-6), so the test sums each
row's chance of a tie (the length of [0, 1) within ``w`` of a step) and caps the count at that
expectation plus four standard deviations plus 3. A row is a boundary tie when the top-p mass
before the cut lies within ``w`` of p, or a token's probability within its rounding of
min_p · p_max: the task may keep one token more or less there, and its token must be kept under
the loosened boundary. Every other row must match exactly."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.engine.sampling import uniform
from mpk.ops.sampling import digit_levels, segments
from mpk.testing.chi_square import CHI2_ALPHA, chi_square_p

pytestmark = pytest.mark.gpu
DEV = "cuda"
V = 151_936
EXP2F_REL = 2.0 ** -22  # exp2f: at most 2 ulp
ARG_REL = 2.0 ** -24 * math.log(2)  # per unit of 2|a| + 1: the fma's rounding and scale's
FIXED_ABS = 2.0 ** -40  # round(e · 2^40) in a segment's unit, at most p_max's 2^-40
SHIFT_ABS = 2.0 ** -39 * segments(V)  # each segment's sum shifted into the row's unit

MIXES = {  # temperature, top_k, top_p, min_p
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k": (1.0, 50, 1.0, 0.0),
    "top_p": (1.0, 0, 0.9, 0.0),
    "min_p": (1.0, 0, 1.0, 0.05),
    "top_k_top_p": (0.7, 50, 0.9, 0.0),
    "all": (1.2, 200, 0.95, 0.01),
    "k_at_least_v": (1.0, V + 5, 1.0, 0.0),
    "top_k_one": (1.0, 1, 1.0, 0.0),
}


def _gpu_sampler():
    return torch.compile(lambda *a: torch.ops.mpk.sample(*a), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu"})


def _params(B: int, mix, rng: random.Random) -> list[torch.Tensor]:
    """The mix's parameters for every row, or (mix None) a different random mix per row."""
    rows = [mix or MIXES[rng.choice(sorted(MIXES))] for _ in range(B)]
    dtypes = (torch.float32, torch.int32, torch.float32, torch.float32)
    cols = [torch.tensor([r[i] for r in rows], dtype=d, device=DEV) for i, d in enumerate(dtypes)]
    seed = torch.tensor([rng.getrandbits(64) - (1 << 63) for _ in range(B)], dtype=torch.int64, device=DEV)
    counter = torch.tensor([rng.getrandbits(40) for _ in range(B)], dtype=torch.int64, device=DEV)
    return cols + [seed, counter]


def mass_error(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each token's bound on the task's relative mass error (float64, module docstring)."""
    a = (x - x.max()) * (math.log2(math.e) / temperature)
    return EXP2F_REL + ARG_REL * (2 * a.abs() + 1)


def min_p_error(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each token's bound on the relative error of min-p's test exp2f((x − max)·scale) (float64):
    exp2f's 2 ulp and the roundings of x − max, of the product and of scale."""
    a = (x - x.max()) * (math.log2(math.e) / temperature)
    return EXP2F_REL + 3 * ARG_REL * a.abs()


def cdf_window(e: torch.Tensor, err: torch.Tensor) -> float:
    """The bound on the task's error in a CDF value over the tokens of masses ``e`` (float64, in
    units of p_max) and relative errors ``err``: twice the mass-weighted error plus the fixed
    point's rounding (n + 1 roundings, the total's among them) and the segments' shifts relative
    to the total."""
    W = float(e.sum())
    return 2 * float((e * err).sum()) / W + ((e.numel() + 1) * FIXED_ABS + SHIFT_ABS) / W


def tie_chance(cdf: torch.Tensor, w: float) -> float:
    """The length of [0, 1) within ``w`` of a step of ``cdf`` (inside steps only: 0 and the end
    are no boundary): a uniform's chance of a draw tie."""
    inner = cdf[:-1]
    if inner.numel() == 0:
        return 0.0
    gaps = torch.diff(inner).clamp(max=2 * w)
    return min(1.0, 2 * w + float(gaps.sum()))


def reference64(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                u: float) -> dict:
    """One row by mpk.engine.sampling's definition in float64: ``token``; ``kept`` (ids kept by
    the filters, in order); ``allowed`` (ids kept under boundaries loosened by their rounding);
    ``draw_tie`` (the uniform lies within the row's window of the drawn token's CDF step);
    ``boundary_tie`` (a top-p or min-p boundary lies within its rounding); ``chance`` (the
    row's probability of a draw tie over uniforms)."""
    x = x.double()
    if temperature <= 0:
        t = int(torch.argmax(x))
        return dict(token=t, kept=[t], allowed=[t], draw_tie=False, boundary_tie=False, chance=0.0)
    e = torch.exp((x - x.max()) / temperature)  # masses in units of p_max
    err = mass_error(x, temperature)
    p = e / e.sum()
    srt, order = torch.sort(p, descending=True)
    n = p.shape[0]
    k = top_k if 0 < top_k < n else n
    floor = loose = srt[k - 1]
    boundary_tie = False
    if top_p < 1:
        before = torch.cumsum(srt, 0) - srt
        last = int((before < top_p).sum().clamp(1, n)) - 1
        floor = torch.maximum(floor, srt[last])
        near = before[last:last + 2]  # the last kept position's mass before it, and the first cut's
        w_z = cdf_window(e, err)  # the task's before-mass and total are sums over every token
        if bool(((near - top_p).abs() < w_z).any()):
            boundary_tie = True
            loose = torch.maximum(loose, srt[min(last + 1, n - 1)])
        else:
            loose = torch.maximum(loose, srt[last])
    if min_p > 0:
        ratio = e  # p / p_max
        m_err = min_p_error(x, temperature)
        near = (ratio - min_p).abs() < m_err * min_p  # e's rounding (p_max's e is exp2f(0) = 1, exact)
        floor = torch.maximum(floor, min_p * srt[0])
        if bool(near.any()):
            boundary_tie = True
            loose = torch.maximum(loose, min_p * (1 - float(m_err[near].max())) * srt[0])
        else:
            loose = torch.maximum(loose, min_p * srt[0])
    kept = (p >= floor).nonzero().flatten()
    allowed = (p >= loose).nonzero().flatten().tolist()
    q = e[kept] / e[kept].sum()
    cdf = torch.cumsum(q, 0)
    i = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64, device=cdf.device),
                                   right=True)), len(kept) - 1)
    lo = float(cdf[i - 1]) if i > 0 else 0.0
    w = cdf_window(e[kept], err[kept]) + 2.0 ** -39  # and the draw's ⌊u · W⌋ and rest in a segment's unit
    draw_tie = i < len(kept) - 1 and abs(float(cdf[i]) - u) < w or i > 0 and abs(lo - u) < w
    # every kept token whose CDF step [C_{j-1}, C_j) comes within w of u: steps narrower than w
    # (tokens of mass below the window) make several of them candidates, not only neighbours
    starts = torch.cat([cdf.new_zeros(1), cdf[:-1]])
    near = ((starts - w <= u) & (u < cdf + w)).nonzero().flatten()
    return dict(token=int(kept[i]), kept=kept.tolist(), allowed=allowed, draw_tie=draw_tie,
                window=kept[near].tolist(), boundary_tie=boundary_tie, chance=tie_chance(cdf, w))


def _check(tokens: torch.Tensor, logits: torch.Tensor, params: list[torch.Tensor]) -> dict:
    """Each row's token against reference64; counts of rows, draw ties, boundary ties and the
    expected draw ties."""
    cols = [t.tolist() for t in params]
    stats = dict(rows=0, draw_ties=0, boundary_ties=0, expected=0.0)
    for b, got in enumerate(tokens.tolist()):
        t, k, p, mp, seed, counter = (c[b] for c in cols)
        u = uniform(seed & ((1 << 64) - 1), counter)
        ref = reference64(logits[b], t, k, p, mp, u)
        want = ref["token"]
        stats["rows"] += 1
        stats["expected"] += ref["chance"]
        if t <= 0:
            assert got == int(torch.argmax(logits[b].float())) == want, f"row {b}: greedy {got}, argmax {want}"
        elif ref["boundary_tie"]:
            stats["boundary_ties"] += 1
            assert got in ref["allowed"], (b, got, want)
        elif ref["draw_tie"]:
            stats["draw_ties"] += 1
            assert got in ref["window"], (b, got, want, ref["window"])
        else:
            assert got == want, f"row {b} (t {t}, k {k}, p {p}, min_p {mp}, u {u}): token {got}, reference {want}"
    return stats


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 64),
                                         (torch.float32, 16), (torch.float16, 16)])
def test_task_matches_the_reference_on_a_qwen3_vocabulary(dtype, batch):
    rng = random.Random(torch.initial_seed())
    fn = _gpu_sampler()
    total = dict(rows=0, draw_ties=0, boundary_ties=0, expected=0.0)
    for mix in [*MIXES.values(), None]:
        for scale in (1.0, 4.0):  # flat and peaked distributions
            logits = (scale * torch.randn(batch, V, device=DEV)).to(dtype)
            logits[:, rng.randrange(V)] = logits.max()  # a tie at the top: greedy takes the lower id
            params = _params(batch, mix, rng)
            COMPILED.clear()
            tokens = fn(logits, *params)
            if COMPILED:
                assert [o["kind"] for o in COMPILED[-1].tables.meta["ops"]] == (
                    ["sample_partial"] + ["sample_digit"] * (digit_levels(dtype) - 1) + ["sample"])
            for key, v in _check(tokens.cpu(), logits.cpu(), [p.cpu() for p in params]).items():
                total[key] += v
            # the same seeds and counters again: the same tokens, bit for bit
            assert torch.equal(fn(logits, *params), tokens)
    # draw ties are Bernoulli trials of the rows' chances: above mean + 4σ + 3 is a task error
    cap = total["expected"] + 4 * math.sqrt(total["expected"]) + 3
    assert total["draw_ties"] <= cap, f"{total}: more draw ties than the rows' rounding windows explain ({cap:.1f})"


def test_gpu_draws_follow_the_filtered_distribution():
    from mpk.engine.sampling import filtered_probs

    Vs, N = 16, 20_000  # float32 logits: rows of whole 16-byte words
    logits = torch.randn(1, Vs)
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (0.8, 8, 0.9, 0.0), (1.0, 0, 1.0, 0.1)]:
        params = [torch.tensor([v], dtype=d) for v, d in zip((temperature, top_k, top_p, min_p),
                                                              (torch.float32, torch.int32, torch.float32,
                                                               torch.float32))]
        probs = filtered_probs(logits, *params)[0]
        rows = [t.expand(N).contiguous().to(DEV) for t in params]
        seed = torch.full((N,), random.getrandbits(63), device=DEV)
        tokens = _gpu_sampler()(logits.expand(N, Vs).contiguous().to(DEV), *rows, seed,
                                torch.arange(N, device=DEV))
        counts = torch.bincount(tokens.cpu(), minlength=Vs)
        assert int(counts[probs == 0].sum()) == 0, "a filtered-out token was drawn"
        assert chi_square_p(counts, probs) > CHI2_ALPHA, (counts.tolist(), probs.tolist())
