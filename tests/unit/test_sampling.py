"""Sampling: ``torch.ops.mpk.sample`` compiled for the CPU interpreter against the eager
reference (``mpk.engine.sampling.sample``) on fresh random logits for every parameter mix;
``SamplingParams.validate``'s errors; seeded reproducibility; the draws' distribution
(chi-square goodness of fit) and that filtered-out tokens are never drawn."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.engine.sampling import SamplingParams, filtered_probs, sample, uniform
from mpk.errors import BadInputError
from mpk.ops import OpSig, get_op
from mpk.ops.sampling import SEGMENT, row_argmax
from mpk.testing.chi_square import CHI2_ALPHA, chi2_sf, chi_square_p

def _compiled():
    return torch.compile(lambda *a: torch.ops.mpk.sample(*a), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu"})


def _params(B: int, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, ...]:
    """[B] parameter tensors of the op (each argument a scalar for every row or a list)."""
    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * B, dtype=dtype)
    return col(temperature, torch.float32), col(top_k, torch.int32), col(top_p, torch.float32), col(min_p, torch.float32)


def _seeds(B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 64-bit seeds (as int64: negative ones too) and counters."""
    seed = torch.tensor([random.getrandbits(64) - (1 << 63) for _ in range(B)], dtype=torch.int64)
    return seed, torch.randint(0, 1 << 40, (B,), dtype=torch.int64)


def _reference(logits, temperature, top_k, top_p, min_p, seed, counter) -> torch.Tensor:
    return sample(logits, temperature, top_k, top_p, min_p, [s & ((1 << 64) - 1) for s in seed.tolist()],
                  counter.tolist())


MIXES = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.7, 0, 1.0, 0.0),
    "top_k": (1.0, 20, 1.0, 0.0),
    "top_p": (1.3, 0, 0.8, 0.0),
    "min_p": (1.0, 0, 1.0, 0.1),
    "top_k_top_p": (0.9, 50, 0.9, 0.0),
    "all": (0.8, 30, 0.95, 0.02),
    "k_at_least_v": (1.0, 100_000, 1.0, 0.0),
    "k_minus_one": (1.0, -1, 1.0, 0.0),
    "per_row": ([0.0, 1.0, 0.5, 2.0], [0, 5, 1, 300], [1.0, 0.5, 0.99, 0.7], [0.0, 0.3, 0.0, 0.05]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_compiled_op_equals_the_reference(mix, dtype):
    B, V = 4, 1000
    logits = (3 * torch.randn(B, V)).to(dtype)
    args = (logits, *_params(B, *MIXES[mix]), *_seeds(B))
    COMPILED.clear()
    got = _compiled()(*args)
    assert [o["kind"] for o in COMPILED[-1].tables.meta["ops"]] == ["sample_partial", "sample"]  # not a fallback
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got, _reference(*args))
    assert torch.equal(torch.ops.mpk.sample(*args), got)


@pytest.mark.parametrize("V", [SEGMENT + 3, 3 * SEGMENT])
@pytest.mark.parametrize("mix", ["greedy", "k_at_least_v", "top_k_top_p", "all"])
def test_rows_over_several_segments_equal_the_reference(mix, V):
    # odd V (a short last segment), maxima tied across segments (greedy takes the lowest id, the
    # first segment's), k ≥ V, p = 1 and per-segment tiles through the CPU interpreter
    B = 3
    logits = torch.randn(B, V)
    logits[0, [5, SEGMENT + 1, V - 1]] = 9.0  # a tie split over segments
    logits[1, [V - 2, SEGMENT - 1]] = 9.0  # the later id in the earlier segment
    logits[2, V - 1] = float("nan")  # torch.argmax takes the first NaN
    args = (logits, *_params(B, *MIXES[mix]), *_seeds(B))
    COMPILED.clear()
    got = _compiled()(*args)
    ops = COMPILED[-1].tables.meta["ops"]
    assert [o["kind"] for o in ops] == ["sample_partial", "sample"]
    if mix == "greedy":
        assert got.tolist() == [5, SEGMENT - 1, V - 1]
    else:
        assert torch.equal(got[:2], _reference(*args)[:2])
    assert torch.equal(torch.ops.mpk.sample(*args), got)


def test_partials_hold_each_segments_max_and_first_index():
    V = 2 * SEGMENT + 8
    x = torch.randn(2, V).bfloat16()
    x[0, [SEGMENT + 1, SEGMENT + 4]] = 50  # a tie inside segment 1: its first index
    part = get_op("sample_partial").cpu(OpSig(((2, V),), (2, 3, 2), torch.float32), ((0, 2), (1, 3), (0, 2)),
                                        [x[:, SEGMENT:]])
    assert part.shape == (2, 2, 2)
    assert part[0, 0].tolist() == [50.0, SEGMENT + 1]
    for b in range(2):
        for j, s in enumerate((1, 2)):
            seg = x[b, s * SEGMENT:(s + 1) * SEGMENT].float()
            assert part[b, j, 0] == seg.max() and int(part[b, j, 1]) == s * SEGMENT + int(torch.argmax(seg))
    assert row_argmax(part).tolist() == [SEGMENT + 1, int(torch.argmax(x[1, SEGMENT:].float())) + SEGMENT]


def test_ties_greedy_takes_the_lowest_id_and_boundaries_keep_every_tie():
    V = 16
    logits = torch.zeros(3, V)
    logits[:, [3, 7, 11]] = 2.0  # three equal maxima
    # top-k 1 and top-p 0.1 each cut inside the tie: all three stay, nothing else does
    args = (logits, *_params(3, [0.0, 1.0, 1.0], [0, 1, 0], [1.0, 1.0, 0.1], 0.0))
    q = filtered_probs(logits, *args[1:5])
    assert q[0].nonzero().flatten().tolist() == [3]
    for row in (1, 2):
        assert q[row].nonzero().flatten().tolist() == [3, 7, 11]
        assert torch.allclose(q[row, [3, 7, 11]], torch.full((3,), 1 / 3))
    seed, counter = _seeds(3)
    got = _compiled()(*args, seed, counter)
    assert got[0] == 3 and {int(t) for t in got[1:]} <= {3, 7, 11}
    assert torch.equal(got, _reference(*args, seed, counter))


def test_top_p_one_keeps_the_whole_vocabulary():
    # many tiny probabilities: a float32 cumsum reaches 1 before the end, p = 1 must still keep the tail
    V = 50_000
    logits = torch.cat([torch.tensor([20.0]), torch.randn(V - 1)])[None]
    q = filtered_probs(logits, *_params(1, 1.0, 0, 1.0, 0.0))
    assert bool((q > 0).all())


def test_seeded_draws_repeat_and_do_not_depend_on_the_batch():
    V = 500
    logits = torch.randn(8, V)
    params = _params(8, 1.0, 0, 0.95, 0.0)
    seed, counter = _seeds(8)
    fn = _compiled()
    first = fn(logits, *params, seed, counter)
    assert torch.equal(fn(logits, *params, seed, counter), first)
    # row 5 alone gives the token it gave in the batch
    alone = torch.ops.mpk.sample(logits[5:6], *(t[5:6] for t in params), seed[5:6], counter[5:6])
    assert alone.item() == first[5].item()
    # other counters give other uniforms (distinct draws; at least two tokens among 8 counters)
    draws = {torch.ops.mpk.sample(logits[:1], *(t[:1] for t in params), seed[:1], counter[:1] + i).item()
             for i in range(8)}
    assert len(draws) > 1


def test_uniform_is_the_documented_hash():
    # uniform = top 24 bits of mix64(mix64(seed) + counter) / 2^24: values from an independent
    # SplitMix64 (its first outputs from state 0: mix64(γ), mix64(2γ), …)
    gamma = 0x9E3779B97F4A7C15
    from mpk.engine.sampling import mix64
    assert mix64(gamma) == 0xE220A8397B1DCDAF  # SplitMix64(0)'s first output
    assert uniform(0, gamma) == (mix64(mix64(0) + gamma) >> 40) / 2 ** 24
    assert 0 <= uniform(random.getrandbits(64), random.getrandbits(40)) < 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("top_k", 2.0), ("min_p", 1.5), ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("ignore_eos", 1), ("seed", -1), ("seed", 1 << 64), ("logprobs", 21),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(BadInputError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value}).validate()


def test_validate_checks_stop_token_ids_against_the_vocabulary():
    assert SamplingParams(stop_token_ids=[5]).validate(vocab=6).stop_token_ids == [5]
    with pytest.raises(BadInputError, match=r"stop_token_ids.*\[0, 6\)"):
        SamplingParams(stop_token_ids=[6]).validate(vocab=6)


def test_bad_inputs_name_the_argument():
    logits = torch.randn(2, 10)
    params = list(_params(2, 1.0, 0, 1.0, 0.0)) + list(_seeds(2))
    bad = list(params)
    bad[1] = bad[1].long()  # top_k as int64
    with pytest.raises(BadInputError, match="top_k is int64"):
        torch.ops.mpk.sample(logits, *bad)
    with pytest.raises(BadInputError, match=r"seed is int64 \[3\]; expected int64 \[2\]"):
        torch.ops.mpk.sample(logits, *params[:4], torch.zeros(3, dtype=torch.int64), params[5])
    with pytest.raises(BadInputError, match="logits are int64"):
        torch.ops.mpk.sample(logits.long(), *params)


def test_chi2_sf_matches_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(23.209251158954356, 10) == pytest.approx(0.01, rel=1e-9)


@pytest.mark.parametrize("mix", ["temperature", "top_k_top_p", "all", "min_p"])
def test_draws_follow_the_filtered_distribution(mix):
    V, N = 12, 20_000
    logits = torch.randn(1, V)
    params = _params(1, *MIXES[mix][:1], min(MIXES[mix][1], 6), *MIXES[mix][2:])
    probs = filtered_probs(logits, *params)[0]
    seed = random.getrandbits(63)
    # N distinct counters of one seed: the batch is N copies of the row
    rows = [t.expand(N) for t in params]
    tokens = torch.ops.mpk.sample(logits.expand(N, V), *rows, torch.full((N,), seed), torch.arange(N))
    counts = torch.bincount(tokens, minlength=V)
    assert int(counts[probs == 0].sum()) == 0, "a filtered-out token was drawn"
    assert chi_square_p(counts, probs) > CHI2_ALPHA, (counts.tolist(), probs.tolist())
