"""The ``sample`` op kind: one token per row of logits under that row's sampling parameters.

Inputs: logits [B, V] (float32, float16 or bfloat16), then per row temperature [B] float32,
top_k [B] int32, top_p [B] float32, min_p [B] float32, seed [B] int64 and counter [B] int64;
output tokens [B] int64. The semantics are ``mpk.engine.sampling.sample``'s: temperature 0 is
argmax (lowest id among ties); else softmax(logits / temperature), filtered by top-k, top-p and
min-p (boundary ties kept), drawn by inverse CDF in token-id order at the counter-based uniform
of (seed, counter). A seed is read as its 64 bits (a negative int64 is the seed 2**64 + it).

The filters are one threshold on the logits' order-preserving keys (``keys``: K = 16 bits for
bf16/f16, 32 for float32): keep key ≥ max(top-k's, top-p's, min-p's). It is found by a radix
select of D = K / 8 digits of 8 bits, every pass segment-parallel — tiles are (row, SEGMENT-long
segment) pairs, so a row's reads spread over S = ⌈V / SEGMENT⌉ workers — and the op kinds that
carry it (the rule, mpk.frontend.rules.sampling, emits them in this order) are:

* ``sample_partial`` (a (row, segment) tile): the segment's max and first index of it
  (torch.argmax's order), and its first-digit histogram: per digit the count of tokens and
  their mass in fixed point, ``masses``: round(2^(x·scale − E_s) · 2^40), scale = log2(e)/T,
  relative to the segment's own power of two E_s = ⌈segmax·scale⌉ (``seg_ref``) — the row's max
  is not known yet. A segment's integer sums are exact (≤ 2^54) and a row adds them in its own
  unit 2^(E_row − 40) by a right shift of E_row − E_s (E_row = the largest E_s; ``plan``), so
  every sum is an integer in a fixed order: the same seed and counter give the same token bit
  for bit, with no float atomic anywhere;
* ``sample_digit`` (level L = 2…D, one op a level; a (row, segment) tile): from the row's
  histograms of levels < L (read whole: S · 4 KiB a level), every tile selects the same digits
  so far (``plan``), then counts and weighs digit L of its segment's tokens under that prefix.
  Its output repeats the previous level op's histograms before its own, so the last one holds
  levels 2…D and the ``sample`` op reads 9 inputs (the tasks' most) for float32 too;
* ``sample`` (a row a tile): selects the last digit, so the exact threshold, and each
  segment's kept mass from the histograms alone; picks the segment holding ⌊u·W⌋ (W the kept
  mass) in id order, re-reads that segment only and finds the token by inverse CDF. A greedy row
  (temperature ≤ 0) is the first segment holding the row's max, at that segment's index.

Selecting a level: top-k's digit is where the count from the top first reaches k; top-p's where
the mass from the top first reaches ⌈p · Z⌉ (the smallest logit whose strictly larger logits
weigh less than p); min-p's threshold key needs no data: the smallest key whose value has
exp2f((x − max)·scale) ≥ min_p, found by bisection over the key space (``min_p_key``). The
level's digit is the largest of the active thresholds' digits; a threshold whose digit is
smaller is below the final one and drops out. It agrees with the reference except where float
rounding decides (a top-p cut or a draw within a rounding of a CDF step, or distinct logits
whose probabilities round equal at a boundary); the CPU tiles below compute the same integers
as the CUDA tasks (cuda/mpk_tasks/sampling.cuh) up to exp2's last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mpk.ops.gpu import CTYPES, DTYPE_SIZE, GpuSpec, OpInfo, Params, check_contiguous
from mpk.ops.registry import OpDef, OpSig, register

# The inputs' dtypes after logits, in order (the op's schema; the task reads them by dtype code).
PARAM_DTYPES = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
                "min_p": torch.float32, "seed": torch.int64, "counter": torch.int64}
LOGIT_DTYPES = tuple(CTYPES)  # float32, float16, bfloat16
# logits per segment: 32 KiB of bf16. Longer segments mean fewer histograms for every tile to
# merge (B·S² · 4 KiB of L2 reads a level); shorter, more workers on a small batch.
SEGMENT = 16384
BINS = 256  # a radix digit's values (8 bits)
PARTIAL_FIELDS = 2 + 2 * BINS  # [max's float32 bits, first index, counts[BINS], masses[BINS]]
DIGIT_FIELDS = 2 * BINS  # a level's [counts[BINS], masses[BINS]]
MASS_BITS = 40  # a token's mass is round(e · 2^40), e ≤ 1 (+ a rounding)
# a partial holds an index in int64 and a segment's masses sum below 2^(40 + log2 SEGMENT + 1):
# a row's sum (in row units) must stay below 2^63 too
MAX_VOCAB = 1 << 22
MAX_SEGMENTS = MAX_VOCAB // SEGMENT  # the tasks keep a shift per segment in shared memory
LOG2E = 1.4426950408889634
_MASK64 = (1 << 64) - 1


def segments(vocab: int) -> int:
    """How many segments a row of ``vocab`` logits has."""
    return -(-vocab // SEGMENT)


def key_bits(dtype: torch.dtype) -> int:
    """The width K of the logits' keys (their bits)."""
    return 8 * torch.empty((), dtype=dtype).element_size()


def digit_levels(dtype: torch.dtype) -> int:
    """The radix select's levels D (8-bit digits of a K-bit key)."""
    return key_bits(dtype) // 8


def keys(x: torch.Tensor) -> torch.Tensor:
    """The logits' bits as int64 keys in the value order (K bits wide): negative values
    reversed, -0 as +0, every NaN the largest (torch's order). sampling.cuh: sample_key."""
    K = key_bits(x.dtype)
    top, full = 1 << (K - 1), (1 << K) - 1
    b = x.contiguous().view(torch.int32 if K == 32 else torch.int16).long() & full
    b = torch.where(b == top, 0, b)
    k = torch.where(b & top != 0, ~b & full, b | top)
    return torch.where(torch.isnan(x), full, k)


def key_values(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of int64 keys ``k`` of ``dtype``'s logits (keys' inverse)."""
    K = key_bits(dtype)
    top, full = 1 << (K - 1), (1 << K) - 1
    b = torch.where(k & top != 0, k ^ top, ~k & full)
    b = torch.where(b >= top, b - (1 << K), b)  # as a signed K-bit int
    return b.to(torch.int32 if K == 32 else torch.int16).view(dtype).float()


def scales(temperature: torch.Tensor) -> torch.Tensor:
    """log2(e)/T in float32 (the tasks' ``scale``; T > 0)."""
    return torch.tensor(LOG2E, dtype=torch.float32) / temperature.float()


def seg_ref(segmax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A segment's power of two E_s = ⌈segmax·scale⌉ (float32; 0 where not finite: a segment of
    -inf or NaN)."""
    a = segmax * scale
    return torch.where(torch.isfinite(a), torch.ceil(a), torch.zeros_like(a))


def masses(x: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Fixed-point masses round(exp2f(fmaf(x, scale, −ref)) · 2^40) (int64; NaN weighs 0).
    x·scale is exact in float64 and so is the subtraction: one float32 rounding, as fmaf's."""
    a = (x.double() * scale.double() - ref.double()).float()
    e = torch.exp2(a).double() * float(1 << MASS_BITS)
    return torch.round(torch.nan_to_num(e, nan=0.0)).long()


def _histogram(digit: torch.Tensor, weight: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[R, 2·BINS]: per row the count and the summed weight of the entries ``where`` holds, by digit."""
    R = digit.shape[0]
    w = where.long()
    counts = torch.zeros(R, BINS, dtype=torch.int64).scatter_add_(1, digit, w)
    mass = torch.zeros(R, BINS, dtype=torch.int64).scatter_add_(1, digit, weight * w)
    return torch.cat([counts, mass], 1)


def _maxarg(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max (float32) and first index of it, torch.argmax's order (the first NaN)."""
    arg = torch.argmax(seg, dim=-1)
    return seg.gather(1, arg[:, None])[:, 0], arg


def _partial_regions(sig: OpSig, rect):
    """Tile (rows, segments s0…s1) reads those rows' logits from s0·SEGMENT to s1·SEGMENT (or
    V) and their temperatures."""
    rows, (s0, s1), _ = rect
    return [(rows, (s0 * SEGMENT, min(sig.in_shapes[0][1], s1 * SEGMENT))), (rows,)]


def _partial_cpu(sig: OpSig, rect, xs):
    """Each segment's max, first index and first-digit histogram (zeros for a greedy row)."""
    logits, temperature = xs
    _, (s0, s1), _ = rect
    R, K = logits.shape[0], key_bits(logits.dtype)
    out = torch.zeros(R, s1 - s0, PARTIAL_FIELDS, dtype=torch.int64)
    sampled = temperature > 0
    scale = scales(torch.where(sampled, temperature, torch.ones_like(temperature)))
    for j in range(s1 - s0):
        raw = logits[:, j * SEGMENT:(j + 1) * SEGMENT]
        seg = raw.float()
        mx, arg = _maxarg(seg)
        out[:, j, 0] = mx.view(torch.int32).long()
        out[:, j, 1] = arg + (s0 + j) * SEGMENT
        m = masses(seg, scale[:, None], seg_ref(mx, scale)[:, None])
        out[:, j, 2:] = _histogram(keys(raw) >> (K - 8), m, sampled[:, None].expand_as(m))
    return out


def _select(hist: torch.Tensor, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the digit where hist's running total from digit 255 down first reaches ``need``,
    and the total of the digits above it. Where the total falls short (masses summed in row units
    round down per segment, so a level can weigh a unit less than its parent bin): digit 0.
    sampling.cuh: select_digit."""
    desc = hist.flip(1)
    incl = torch.cumsum(desc, 1)
    pos = (incl < need[:, None]).sum(1)
    short = pos == BINS
    pos = pos.clamp(max=BINS - 1)
    above = incl.gather(1, pos[:, None])[:, 0] - desc.gather(1, pos[:, None])[:, 0]
    return torch.where(short, 0, BINS - 1 - pos), above


def min_p_key(mx: torch.Tensor, scale: torch.Tensor, min_p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest key of ``dtype`` whose value x has exp2f((x − mx)·scale) ≥ min_p (a monotone
    test: bisection over [0, key(mx)], K steps), per row. sampling.cuh: min_p_key."""
    K = key_bits(dtype)
    lo = torch.zeros_like(mx, dtype=torch.int64)
    hi = keys(mx.to(dtype))
    for _ in range(K):
        mid = (lo + hi) // 2
        ok = torch.exp2((key_values(mid, dtype) - mx) * scale) >= min_p
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid + 1)
    return hi


@dataclass
class Plan:
    """A row's radix select after ``levels`` levels ([R] tensors but ``digits``, ``shift``)."""

    greedy: torch.Tensor  # temperature ≤ 0
    token: torch.Tensor  # the argmax (torch.argmax's)
    scale: torch.Tensor
    ref: torch.Tensor  # [R, S] each segment's E_s
    shift: torch.Tensor  # [R, S] E_row − E_s, at most 63: a segment's sums >> it are in row units
    prefix: torch.Tensor  # the selected digits in place (the top 8·levels key bits)
    digits: list[torch.Tensor]  # each level's selected digit


def split_levels(hists: torch.Tensor | None) -> list[torch.Tensor]:
    """A sample_digit output [R, S, n·DIGIT_FIELDS] (None: none yet) as its n levels."""
    return [] if hists is None else list(hists.split(DIGIT_FIELDS, dim=2))


def plan(partials: torch.Tensor, levels: list[torch.Tensor], temperature: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, min_p: torch.Tensor, vocab: int, dtype: torch.dtype) -> Plan:
    """The digits of a row's threshold selected from its partials [R, S, PARTIAL_FIELDS] and the
    histograms of the later ``levels`` ([R, S, DIGIT_FIELDS] each): the same integers in every
    tile that needs them (sampling.cuh: sample_plan)."""
    K = key_bits(dtype)
    segmax = partials[:, :, 0].to(torch.int32).view(torch.float32)
    first = torch.argmax(segmax, dim=1)  # the first segment holding the max (or a NaN)
    token = partials[:, :, 1].gather(1, first[:, None])[:, 0]
    mx = segmax.gather(1, first[:, None])[:, 0]
    greedy = ~(temperature > 0)
    scale = scales(torch.where(greedy, torch.ones_like(temperature), temperature))
    ref = seg_ref(segmax, scale[:, None])
    shift = (ref.max(1).values[:, None] - ref).clamp(max=63).long()
    hists = [partials[:, :, 2:]] + list(levels)

    def row_units(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h[:, :, :BINS].sum(1), (h[:, :, BINS:] >> shift[:, :, None]).sum(1)

    k = top_k.long()
    act_k = ~greedy & (k > 0) & (k < vocab)
    act_p = ~greedy & (top_p < 1)
    act_m = ~greedy & (min_p > 0)
    m_key = min_p_key(mx, scale, min_p, dtype)
    z = row_units(hists[0])[1].sum(1)
    p_target = torch.ceil(top_p.double() * z.double()).long().clamp(min=1)
    k_above = torch.zeros_like(k)
    p_above = torch.zeros_like(k)
    prefix = torch.zeros_like(k)
    digits = []
    for level, h in enumerate(hists, 1):
        sh = K - 8 * level
        counts, mass = row_units(h)
        dk, ak = _select(counts, k - k_above)
        dp, ap = _select(mass, p_target - p_above)
        dm = (m_key >> sh) & (BINS - 1)
        d = torch.maximum(torch.maximum(torch.where(act_k, dk, 0), torch.where(act_p, dp, 0)),
                          torch.where(act_m, dm, 0))
        act_k, act_p, act_m = act_k & (dk == d), act_p & (dp == d), act_m & (dm == d)
        k_above = k_above + torch.where(act_k, ak, 0)
        p_above = p_above + torch.where(act_p, ap, 0)
        prefix = prefix | (d << sh)
        digits.append(d)
    return Plan(greedy, token, scale, ref, shift, prefix, digits)


def row_argmax(partials: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64 [B]) from its segments' partials [B, S, PARTIAL_FIELDS]: the
    first segment holding the row's max (a NaN first of all), at that segment's first index."""
    segmax = partials[:, :, 0].to(torch.int32).view(torch.float32)
    return partials[:, :, 1].gather(1, torch.argmax(segmax, dim=1)[:, None])[:, 0]


def _digit_regions(sig: OpSig, rect):
    """Tile (rows, segments s0…s1) reads those segments of logits, the rows' parameters and
    the rows' partials and earlier levels whole."""
    rows, (s0, s1), _ = rect
    S = sig.in_shapes[5][1]
    return ([(rows, (s0 * SEGMENT, min(sig.in_shapes[0][1], s1 * SEGMENT)))] + [(rows,)] * 4
            + [(rows, (0, S), (0, PARTIAL_FIELDS))] + [(rows, (0, S), (0, shape[2])) for shape in sig.in_shapes[6:]])


def _digit_cpu(sig: OpSig, rect, xs):
    """The earlier levels' histograms of the tile's segments, then digit ``level`` of their
    tokens under the prefix selected so far: count and mass per digit (zeros for a greedy row)."""
    logits, temperature, top_k, top_p, min_p, partials, *prev = xs
    _, (s0, s1), _ = rect
    level, K = sig.attrs["level"], key_bits(logits.dtype)
    earlier = split_levels(prev[0] if prev else None)
    pl = plan(partials, earlier, temperature, top_k, top_p, min_p, sig.in_shapes[0][1], logits.dtype)
    out = torch.zeros(logits.shape[0], s1 - s0, DIGIT_FIELDS, dtype=torch.int64)
    for j in range(s1 - s0):
        raw = logits[:, j * SEGMENT:(j + 1) * SEGMENT]
        key = keys(raw)
        hi = K - 8 * (level - 1)  # the bits below the prefix
        cand = ((key >> hi) == (pl.prefix >> hi)[:, None]) & ~pl.greedy[:, None]
        m = masses(raw.float(), pl.scale[:, None], pl.ref[:, s0 + j, None])
        out[:, j] = _histogram((key >> (hi - 8)) & (BINS - 1), m, cand)
    return torch.cat([prev[0][:, s0:s1], out], 2) if prev else out


def _sample_regions(sig: OpSig, rect):
    """Tile rows b0…b1 read those rows of logits, whole, those entries of each parameter, and
    those rows' partials and histograms."""
    (rows,) = rect
    S = sig.in_shapes[7][1]
    return ([(rows, (0, sig.in_shapes[0][1]))] + [(rows,)] * len(PARAM_DTYPES)
            + [(rows, (0, S), (0, PARTIAL_FIELDS)), (rows, (0, S), (0, sig.in_shapes[8][2]))])


def uniform24(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Each row's 24-bit uniform integer (mpk.engine.sampling.uniform · 2^24), int64."""
    from mpk.engine.sampling import mix64

    return torch.tensor([mix64(mix64(s & _MASK64) + c) >> 40 for s, c in zip(seed.tolist(), counter.tolist())],
                        dtype=torch.int64)


def kept_masses(pl: Plan, partials: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
    """[R, S] each segment's kept mass in its own units: the tokens whose digit beats the
    selected one at some level, under the prefix before it, plus the last level's selected bin."""
    kept = torch.zeros(partials.shape[:2], dtype=torch.int64)
    digit = torch.arange(BINS)
    for h, d in zip([partials[:, :, 2:]] + list(levels), pl.digits):
        kept += (h[:, :, BINS:] * (digit[None, None, :] > d[:, None, None])).sum(2)
    return kept + levels[-1][:, :, BINS:].gather(2, pl.digits[-1][:, None, None].expand(-1, kept.shape[1], 1))[:, :, 0]


def _sample_cpu(sig: OpSig, rect, xs):
    """The rows' tokens: greedy rows' argmax; the others' draw in the segment holding ⌊u·W⌋."""
    logits, temperature, top_k, top_p, min_p, seed, counter, partials, hists = xs
    V = sig.in_shapes[0][1]
    levels = split_levels(hists)
    pl = plan(partials, levels, temperature, top_k, top_p, min_p, V, logits.dtype)
    seg_kept = kept_masses(pl, partials, levels)
    row_kept = seg_kept >> pl.shift
    W = row_kept.sum(1)
    u = uniform24(seed, counter)
    target = (W >> 24) * u + (((W & 0xFFFFFF) * u) >> 24)  # ⌊W·u / 2^24⌋, exact
    cum = torch.cumsum(row_kept, 1)
    s = (cum <= target[:, None]).sum(1).clamp(max=cum.shape[1] - 1)
    before = cum.gather(1, s[:, None])[:, 0] - row_kept.gather(1, s[:, None])[:, 0]
    rest = (target - before) << pl.shift.gather(1, s[:, None])[:, 0]  # in the segment's units
    tokens = pl.token.clone()
    for b in torch.nonzero(~pl.greedy & (W > 0)).flatten().tolist():
        lo = int(s[b]) * SEGMENT
        raw = logits[b:b + 1, lo:lo + SEGMENT]
        m = masses(raw.float(), pl.scale[b], pl.ref[b, s[b]])[0] * (keys(raw)[0] >= pl.prefix[b])
        tokens[b] = lo + int((torch.cumsum(m, 0) <= rest[b]).sum())
    return tokens.to(sig.out_dtype)


def sample_eager(inputs: list[torch.Tensor]) -> torch.Tensor:
    """torch.ops.mpk.sample outside a compiled graph: the ops' CPU tiles over whole tensors."""
    logits, temperature, top_k, top_p, min_p = inputs[:5]
    B, V = logits.shape
    S = segments(V)
    pshape = (B, S, PARTIAL_FIELDS)
    partials = _partial_cpu(OpSig(((B, V), (B,)), pshape, torch.int64), ((0, B), (0, S), (0, PARTIAL_FIELDS)),
                            [logits, temperature])
    hists: list[torch.Tensor] = []  # the last sample_digit op's output, once there is one
    for level in range(2, digit_levels(logits.dtype) + 1):
        shape = (B, S, (level - 1) * DIGIT_FIELDS)
        sig = OpSig(((B, V),) + ((B,),) * 4 + (pshape,) + tuple(tuple(h.shape) for h in hists), shape, torch.int64,
                    {"level": level})
        hists = [_digit_cpu(sig, ((0, B), (0, S), (0, shape[2])),
                            [logits, temperature, top_k, top_p, min_p, partials, *hists])]
    shapes = tuple(tuple(t.shape) for t in inputs) + (pshape, tuple(hists[0].shape))
    return _sample_cpu(OpSig(shapes, (B,), torch.int64, {}), ((0, B),), [*inputs, partials, hists[0]])


def _logits_word(op: OpInfo) -> tuple[str, int]:
    """The logits' C type and the elements in one of the tasks' 16-byte loads."""
    ctype = CTYPES[op.inputs[0].dtype]
    return ctype, 16 // DTYPE_SIZE[ctype]


def _check(op: OpInfo) -> None:
    """What the tasks assume: logits rows contiguous in whole 16-byte words, a vocabulary whose
    sums and segment shifts fit (MAX_VOCAB)."""
    logits = op.inputs[0]
    if logits.dtype not in CTYPES:
        raise op.error(f"logits are {str(logits.dtype)[6:]}; the CUDA task takes float32, float16 or bfloat16")
    _, vec = _logits_word(op)
    check_contiguous(op, "logits", logits, vec)
    if logits.shape[-1] % vec:
        raise op.error(f"a vocabulary of {logits.shape[-1]} logits; the CUDA task reads rows in 16-byte words, so "
                       f"it needs a multiple of {vec} ({str(logits.dtype)[6:]}): pad the logits with -inf")
    if logits.shape[-1] > MAX_VOCAB:
        raise op.error(f"a vocabulary of {logits.shape[-1]} logits; the masses' 64-bit sums hold up to {MAX_VOCAB}")


def _segment_params(op: OpInfo) -> Params:
    """iparam[0]: SEGMENT (the tasks' segment length); iparam[1]: the digit level (sample_digit)."""
    return [SEGMENT, op.attrs.get("level", 1)], []


_SEGMENT_TILES = dict(splittable=lambda sig: (True, True, False), min_tile_elems=PARTIAL_FIELDS)  # a (row, segment) a tile

register(OpDef(
    kind="sample_partial", type_id=91, input_regions=_partial_regions, cpu=_partial_cpu, **_SEGMENT_TILES,
    gpu=GpuSpec(params=_segment_params, task=lambda op: f"mpk::sample_partial<{_logits_word(op)[0]}>", check=_check,
                vector_inputs=lambda op: (0,)),
    doc="partials [B, S, 2 + 2·256] int64 of logits [B, V] and temperature [B]: each SEGMENT-long segment's max "
        "(float32 bits), first index of it, and first-digit counts and fixed-point masses (sample's first step)",
))

register(OpDef(
    kind="sample_digit", type_id=92, input_regions=_digit_regions, cpu=_digit_cpu, **_SEGMENT_TILES,
    gpu=GpuSpec(params=_segment_params, task=lambda op: f"mpk::sample_digit<{_logits_word(op)[0]}>", check=_check,
                vector_inputs=lambda op: (0,)),
    doc="histograms [B, S, (L − 1)·2·256] int64: the previous sample_digit op's (levels 2 … L − 1), then digit "
        "L = attrs['level'] of each segment's tokens under the prefix selected from (logits, temperature, top_k, "
        "top_p, min_p, partials[, the previous sample_digit op's output])",
))

register(OpDef(
    kind="sample", type_id=18, input_regions=_sample_regions, cpu=_sample_cpu,
    gpu=GpuSpec(params=_segment_params, task=lambda op: f"mpk::sample_rows<{_logits_word(op)[0]}>", check=_check,
                vector_inputs=lambda op: (0,)),
    min_tile_elems=1,  # a row a task: the plan's merge, then one segment's scan by the whole CTA
    doc="tokens [B] = mpk.engine.sampling.sample(logits [B, V], temperature, top_k, top_p, min_p, seed, "
        "counter) (per-row parameters, [B] each), given sample_partial's partials and sample_digit's histograms",
))
