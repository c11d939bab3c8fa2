"""The ``sample`` op kind: one token per row of logits under that row's sampling parameters.

Inputs: logits [B, V] (float32, float16 or bfloat16), then per row temperature [B] float32,
top_k [B] int32, top_p [B] float32, min_p [B] float32, seed [B] int64 and counter [B] int64;
output tokens [B] int64. The semantics are ``mpk.engine.sampling.sample``'s (the CPU tile calls
it): temperature 0 is argmax (lowest id among ties); else softmax(logits / temperature),
filtered by top-k, top-p and min-p (boundary ties kept), drawn by inverse CDF in token-id order
at the counter-based uniform of (seed, counter). A seed is read as its 64 bits (a negative
int64 is the seed 2**64 + it).

Two op kinds carry it (the rule, mpk.frontend.rules.sampling, emits both):

* ``sample_partial``: logits [B, V] → [B, S, 2] float32, S = ⌈V / SEGMENT⌉: each segment's largest
  logit and its first index (torch.argmax's order: the first NaN, else the first largest; the
  index as a float, exact below 2^24). Its tiles are (row, segment) pairs, so a row's one read
  for the max is spread over S workers instead of one;
* ``sample``: the token per row from the logits, the parameters and those partials. A greedy
  row (temperature ≤ 0) is the first segment holding the row's max, at that segment's index: no
  logit is read again. A sampled row takes the whole CTA (cuda/mpk_tasks/sampling.cuh:
  sample_rows), with the max known: radix selects over the logits' bits find the top-k and top-p
  thresholds exactly (by counting, and by summing fixed-point probability mass), and a pass of
  per-group kept mass plus a scan of one group does the inverse CDF in id order. It agrees with
  the reference except where float rounding decides a boundary (a top-p cut or a draw within a
  rounding of a CDF step, or two logits whose probabilities round equal at a top-k / min-p
  boundary).
"""

from __future__ import annotations

import torch

from mpk.ops.gpu import CTYPES, DTYPE_SIZE, GpuSpec, OpInfo, Params, check_contiguous
from mpk.ops.registry import OpDef, OpSig, register

# The inputs' dtypes after logits, in order (the op's schema; the task reads them by dtype code).
PARAM_DTYPES = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
                "min_p": torch.float32, "seed": torch.int64, "counter": torch.int64}
LOGIT_DTYPES = tuple(CTYPES)  # float32, float16, bfloat16
SEGMENT = 8192  # logits per sample_partial segment: 16 KiB of bf16, a short read for one worker
MAX_VOCAB = 1 << 24  # the partials hold an index as a float32, exact below 2^24
_MASK64 = (1 << 64) - 1


def segments(vocab: int) -> int:
    """How many sample_partial segments a row of ``vocab`` logits has."""
    return -(-vocab // SEGMENT)


def _partial_regions(sig: OpSig, rect):
    """Tile (rows, segments s0…s1) reads those rows' logits from s0·SEGMENT to s1·SEGMENT (or V)."""
    rows, (s0, s1), _ = rect
    return [(rows, (s0 * SEGMENT, min(sig.in_shapes[0][1], s1 * SEGMENT)))]


def _partial_cpu(sig: OpSig, rect, xs):
    """Each segment's (max, first index of it) as float32: torch.argmax's order (the first NaN,
    else the first largest)."""
    (logits,) = xs
    _, (s0, s1), _ = rect
    out = torch.empty(logits.shape[0], s1 - s0, 2, dtype=torch.float32)
    x = logits.float()
    for j in range(s1 - s0):
        seg = x[:, j * SEGMENT:(j + 1) * SEGMENT]
        arg = torch.argmax(seg, dim=-1)
        out[:, j, 0] = seg.gather(1, arg[:, None])[:, 0]
        out[:, j, 1] = (arg + (s0 + j) * SEGMENT).float()
    return out


def _sample_regions(sig: OpSig, rect):
    """Tile rows b0…b1 read those rows of logits, whole, those entries of each parameter, and
    those rows' partials."""
    (rows,) = rect
    return ([(rows, (0, sig.in_shapes[0][1]))] + [(rows,)] * len(PARAM_DTYPES)
            + [(rows, (0, sig.in_shapes[-1][1]), (0, 2))])


def row_argmax(partials: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64 [B]) from its segments' partials [B, S, 2]: the first segment
    holding the row's max (a NaN first of all), at that segment's first index of it."""
    arg = torch.argmax(partials[:, :, 0], dim=-1)  # the first segment holding the max (or a NaN)
    return partials[:, :, 1].gather(1, arg[:, None])[:, 0].long()


def _sample_cpu(sig: OpSig, rect, xs):
    from mpk.engine.sampling import sample

    logits, temperature, top_k, top_p, min_p, seed, counter, partials = xs
    seeds = [int(s) & _MASK64 for s in seed.tolist()]
    tokens = sample(logits, temperature, top_k, top_p, min_p, seeds, counter.tolist())
    # greedy rows from the partials, as the CUDA task does (the reference's argmax is the same token)
    return torch.where(temperature <= 0, row_argmax(partials), tokens).to(sig.out_dtype)


def sample_eager(inputs: list[torch.Tensor]) -> torch.Tensor:
    """torch.ops.mpk.sample outside a compiled graph: both ops' CPU tiles over whole tensors."""
    logits = inputs[0]
    B, V = logits.shape
    S = segments(V)
    psig = OpSig((tuple(logits.shape),), (B, S, 2), torch.float32, {})
    partials = _partial_cpu(psig, ((0, B), (0, S), (0, 2)), [logits])
    sig = OpSig(tuple(tuple(t.shape) for t in inputs) + ((B, S, 2),), (B,), torch.int64, {})
    return _sample_cpu(sig, ((0, B),), [*inputs, partials])


def _logits_word(op: OpInfo) -> tuple[str, int]:
    """The logits' C type and the elements in one of the tasks' 16-byte loads."""
    ctype = CTYPES[op.inputs[0].dtype]
    return ctype, 16 // DTYPE_SIZE[ctype]


def _check(op: OpInfo) -> None:
    """What the tasks assume: logits rows contiguous in whole 16-byte words, indices exact in a
    float32."""
    logits = op.inputs[0]
    if logits.dtype not in CTYPES:
        raise op.error(f"logits are {str(logits.dtype)[6:]}; the CUDA task takes float32, float16 or bfloat16")
    _, vec = _logits_word(op)
    check_contiguous(op, "logits", logits, vec)
    if logits.shape[-1] % vec:
        raise op.error(f"a vocabulary of {logits.shape[-1]} logits; the CUDA task reads rows in 16-byte words, so "
                       f"it needs a multiple of {vec} ({str(logits.dtype)[6:]}): pad the logits with -inf")
    if logits.shape[-1] > MAX_VOCAB:
        raise op.error(f"a vocabulary of {logits.shape[-1]} logits; the partials hold indices as float32, exact "
                       f"up to {MAX_VOCAB}")


def _partial_params(op: OpInfo) -> Params:
    """iparam[0]: SEGMENT (the task's segment length)."""
    return [SEGMENT], []


register(OpDef(
    kind="sample_partial", type_id=91, input_regions=_partial_regions, cpu=_partial_cpu,
    splittable=lambda sig: (True, True, False), min_tile_elems=2,  # a tile per (row, segment)
    gpu=GpuSpec(params=_partial_params, task=lambda op: f"mpk::sample_partial<{_logits_word(op)[0]}>", check=_check,
                vector_inputs=lambda op: (0,)),
    doc="partials [B, S, 2] float32: each SEGMENT-long segment of logits [B, V]'s max and first index of it "
        "(S = ⌈V / SEGMENT⌉; sample's first step)",
))

register(OpDef(
    kind="sample", type_id=18, input_regions=_sample_regions, cpu=_sample_cpu,
    gpu=GpuSpec(task=lambda op: f"mpk::sample_rows<{_logits_word(op)[0]}>", check=_check,
                vector_inputs=lambda op: (0,)),
    # a sampled row is a task's work by itself (several passes over it in one CTA)
    min_tile_elems=1,
    doc="tokens [B] = mpk.engine.sampling.sample(logits [B, V], temperature, top_k, top_p, min_p, seed, "
        "counter) (per-row parameters, [B] each), given sample_partial's partials [B, S, 2]",
))
