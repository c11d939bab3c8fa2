"""Sampling: ``torch.ops.mpk.sample`` compiled for the CPU interpreter against the eager
reference (``mpk.engine.sampling.sample``) on fresh random logits for every parameter mix;
``SamplingParams.validate``'s errors; seeded reproducibility; the draws' distribution
(chi-square goodness of fit) and that filtered-out tokens are never drawn."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.engine.sampling import SamplingParams, filtered_probs, sample, uniform
from mpk.errors import BadInputError
from mpk.ops import OpSig, get_op
from mpk.ops.sampling import (BINS, PARTIAL_FIELDS, SEGMENT, digit_levels, key_values, keys, min_p_key, row_argmax,
                               scales)
from mpk.testing.chi_square import CHI2_ALPHA, chi2_sf, chi_square_p

def _kinds(dtype: torch.dtype) -> list[str]:
    """The ops the rule emits: partials, a sample_digit per further radix level, the row op."""
    return ["sample_partial"] + ["sample_digit"] * (digit_levels(dtype) - 1) + ["sample"]


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
    assert [o["kind"] for o in COMPILED[-1].tables.meta["ops"]] == _kinds(dtype)  # not a fallback
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got, _reference(*args))
    assert torch.equal(torch.ops.mpk.sample(*args), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [SEGMENT + 8, 3 * SEGMENT])
@pytest.mark.parametrize("mix", ["greedy", "k_at_least_v", "top_k", "top_p", "min_p", "top_k_top_p", "all"])
def test_rows_over_several_segments_equal_the_reference(mix, V, dtype):
    # odd V (a short last segment), maxima tied across segments (greedy takes the lowest id, the
    # first segment's; the radix select counts every copy), k ≥ V, p = 1, min_p and per-segment
    # tiles of every level through the CPU interpreter
    B = 3
    logits = (2 * torch.randn(B, V)).to(dtype)
    logits[0, [5, SEGMENT + 1, V - 1]] = 20.0  # a tie split over segments
    logits[1, [V - 2, SEGMENT - 1]] = 20.0  # the later id in the earlier segment
    logits[2, V - 1] = float("nan")  # torch.argmax takes the first NaN
    args = (logits, *_params(B, *MIXES[mix]), *_seeds(B))
    COMPILED.clear()
    got = _compiled()(*args)
    assert [o["kind"] for o in COMPILED[-1].tables.meta["ops"]] == _kinds(dtype)
    if mix == "greedy":
        assert got.tolist() == [5, SEGMENT - 1, V - 1]
    else:
        assert torch.equal(got[:2], _reference(*args)[:2])
    assert torch.equal(torch.ops.mpk.sample(*args), got)


def test_partials_hold_each_segments_max_first_index_and_first_digit():
    V = 2 * SEGMENT + 8
    x = torch.randn(2, V).bfloat16()
    x[0, [SEGMENT + 1, SEGMENT + 4]] = 50  # a tie inside segment 1: its first index
    temperature = torch.tensor([0.7, 0.0])  # row 1 greedy: no histogram
    part = get_op("sample_partial").cpu(OpSig(((2, V), (2,)), (2, 3, PARTIAL_FIELDS), torch.int64),
                                        ((0, 2), (1, 3), (0, PARTIAL_FIELDS)), [x[:, SEGMENT:], temperature])
    assert part.shape == (2, 2, PARTIAL_FIELDS)
    segmax = part[:, :, 0].to(torch.int32).view(torch.float32)
    assert segmax[0, 0] == 50.0 and part[0, 0, 1] == SEGMENT + 1
    for j, s in enumerate((1, 2)):
        seg = x[0, s * SEGMENT:(s + 1) * SEGMENT]
        assert segmax[0, j] == seg.float().max() and part[0, j, 1] == s * SEGMENT + int(torch.argmax(seg.float()))
        counts = torch.bincount(keys(seg) >> 8, minlength=BINS)
        assert torch.equal(part[0, j, 2:2 + BINS], counts)
        # each bin's mass: 2^(x·scale − E_s) in units of 2^-40, E_s = ⌈segmax·scale⌉
        scale = float(scales(temperature[:1]))
        ref = math.ceil(float(segmax[0, j]) * scale)
        e = torch.exp2(seg.double() * scale - ref) * 2 ** 40
        for d in (keys(seg) >> 8).unique().tolist():
            assert abs(int(part[0, j, 2 + BINS + d]) - float(e[(keys(seg) >> 8) == d].sum())) <= 1e-5 * float(e.sum())
    assert int(part[1, :, 2:].abs().sum()) == 0
    assert row_argmax(part).tolist() == [SEGMENT + 1, int(torch.argmax(x[1, SEGMENT:].float())) + SEGMENT]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keys_follow_the_value_order_and_invert(dtype):
    x = torch.cat([torch.tensor([float("-inf"), -0.0, 0.0, float("inf")]), 10 * torch.randn(500)]).to(dtype)
    k = keys(x)
    order = torch.argsort(x.float(), stable=True)
    assert bool((torch.diff(k[order]) >= 0).all())
    assert k[1] == k[2]  # -0 is +0
    assert torch.equal(key_values(k, dtype), x.float().abs().where(x == 0, x.float()))


def test_min_p_key_is_the_smallest_passing_key():
    # brute force over every bf16 key: the first key whose value passes exp2f((x − max)·scale) ≥ min_p
    every = torch.arange(1 << 16)
    vals = key_values(every, torch.bfloat16)
    mx, temperature = torch.tensor([3.0, 0.5]), torch.tensor([1.0, 0.3])
    min_p = torch.tensor([0.05, 0.9])
    got = min_p_key(mx, scales(temperature), min_p, torch.bfloat16)
    for b in range(2):
        passing = (torch.exp2((vals - mx[b]) * scales(temperature)[b]) >= min_p[b]) & ~torch.isnan(vals)
        assert int(got[b]) == int(every[passing].min())


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
