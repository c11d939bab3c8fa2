"""Sampling on the GPU (marker ``gpu``; skipped without CUDA): the ``sample`` task
(cuda/mpk_tasks/sampling.cuh) on Qwen3's vocabulary of 151,936 against the reference semantics
(mpk.engine.sampling) for batches of 1, 16 and 64 rows and every parameter mix, token for
token; and its draws' distribution (chi-square).

Greedy rows must equal torch.argmax exactly. A sampled row must equal the reference's token
unless float rounding decides it, which this test detects: the reference is evaluated in
float64 (``reference64``), and a row counts as a rounding tie when the uniform lies within
``TIE`` of a CDF step of the token drawn, the top-p mass before the cut lies within ``TIE`` of
p, or a token's probability lies within a relative ``TIE`` of min_p · p_max. The task's own
errors are far below that: each token's mass is round(e·2^40) with e from exp2f (≤ 2 ulp,
2.4e-7 relative), so a CDF value is off by at most ~2.4e-7 of the total plus V·2^-41 (7e-8).
A tie's token must still be a neighbour of the reference's among the kept tokens."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from mpk.backend import COMPILED
from mpk.engine.sampling import uniform

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_sampling import CHI2_ALPHA, chi_square_p  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
V = 151_936
TIE = 1e-6  # ≈ 4 × the task's CDF error bound (module docstring)

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


def reference64(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                u: float) -> tuple[int, list[int], bool]:
    """(token, kept ids in order, tie) of one row by mpk.engine.sampling's definition in
    float64: the token, the ids kept by the filters, and whether rounding could decide it."""
    x = x.double()
    if temperature <= 0:
        return int(torch.argmax(x)), [], False
    p = torch.softmax(x / temperature, dim=-1)
    srt = torch.sort(p, descending=True).values
    n = p.shape[0]
    k = top_k if 0 < top_k < n else n
    floor = srt[k - 1]
    tie = False
    if top_p < 1:
        before = torch.cumsum(srt, 0) - srt
        last = int((before < top_p).sum().clamp(1, n)) - 1
        floor = torch.maximum(floor, srt[last])
        near = before[last:last + 2]  # the last kept position's mass before it, and the first cut's
        tie |= bool(((near - top_p).abs() < TIE).any())
    if min_p > 0:
        ratio = p / srt[0]
        floor = torch.maximum(floor, min_p * srt[0])
        tie |= bool(((ratio - min_p).abs() < TIE * min_p).any())
    kept = (p >= floor).nonzero().flatten()
    q = p[kept] / p[kept].sum()
    cdf = torch.cumsum(q, 0)
    i = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64, device=cdf.device),
                                   right=True)), len(kept) - 1)
    lo = cdf[i - 1] if i > 0 else torch.zeros((), dtype=torch.float64, device=cdf.device)
    tie |= bool(min(abs(float(cdf[i]) - u), abs(float(lo) - u)) < TIE)
    return int(kept[i]), kept.tolist(), tie


def _check(tokens: torch.Tensor, logits: torch.Tensor, params: list[torch.Tensor]) -> tuple[int, int]:
    """Each row's token against reference64; (rows, ties)."""
    cols = [t.tolist() for t in params]
    ties = 0
    for b, got in enumerate(tokens.tolist()):
        t, k, p, mp, seed, counter = (c[b] for c in cols)
        u = uniform(seed & ((1 << 64) - 1), counter)
        want, kept, tie = reference64(logits[b], t, k, p, mp, u)
        if t <= 0:
            assert got == int(torch.argmax(logits[b].float())) == want, f"row {b}: greedy {got}, argmax {want}"
        elif tie:
            ties += 1
            assert got in kept and abs(kept.index(got) - kept.index(want)) <= 1, (b, got, want)
        else:
            assert got == want, f"row {b} (t {t}, k {k}, p {p}, min_p {mp}, u {u}): token {got}, reference {want}"
    return len(cols[0]), ties


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 64),
                                         (torch.float32, 16), (torch.float16, 16)])
def test_task_matches_the_reference_on_a_qwen3_vocabulary(dtype, batch):
    rng = random.Random(torch.initial_seed())
    fn = _gpu_sampler()
    rows = ties = 0
    for mix in [*MIXES.values(), None]:
        for scale in (1.0, 4.0):  # flat and peaked distributions
            logits = (scale * torch.randn(batch, V, device=DEV)).to(dtype)
            logits[:, rng.randrange(V)] = logits.max()  # a tie at the top: greedy takes the lower id
            params = _params(batch, mix, rng)
            COMPILED.clear()
            tokens = fn(logits, *params)
            if COMPILED:
                assert [o["kind"] for o in COMPILED[-1].tables.meta["ops"]] == ["sample"]
            n, t = _check(tokens.cpu(), logits.cpu(), [p.cpu() for p in params])
            rows, ties = rows + n, ties + t
            # the same seeds and counters again: the same tokens, bit for bit
            assert torch.equal(fn(logits, *params), tokens)
    assert ties <= max(2, rows // 10), f"{ties} of {rows} rows within a rounding of a boundary"


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
