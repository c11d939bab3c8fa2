"""The ``sample`` op kind: one token per row of logits under that row's sampling parameters.

Inputs: logits [B, V] (float32, float16 or bfloat16), then per row temperature [B] float32,
top_k [B] int32, top_p [B] float32, min_p [B] float32, seed [B] int64 and counter [B] int64;
output tokens [B] int64. The semantics are ``mpk.engine.sampling.sample``'s (the CPU tile calls
it): temperature 0 is argmax (lowest id among ties); else softmax(logits / temperature),
filtered by top-k, top-p and min-p (boundary ties kept), drawn by inverse CDF in token-id order
at the counter-based uniform of (seed, counter). A seed is read as its 64 bits (a negative
int64 is the seed 2**64 + it).

The CUDA task (cuda/mpk_tasks/sampling.cuh: sample_rows) gives a row the whole CTA and sorts
nothing: radix selects over the logits' bits find the top-k and top-p thresholds exactly (by
counting, and by summing fixed-point probability mass), and a pass of per-group kept mass plus
a scan of one group does the inverse CDF in id order. It agrees with this reference except
where float rounding decides a boundary (a top-p cut or a draw within a rounding of a CDF step,
or two logits whose probabilities round equal at a top-k / min-p boundary).
"""

from __future__ import annotations

import torch

from mpk.ops.gpu import CTYPES, DTYPE_SIZE, GpuSpec, OpInfo, check_contiguous
from mpk.ops.registry import OpDef, OpSig, register

# The inputs' dtypes after logits, in order (the op's schema; the task reads them by dtype code).
PARAM_DTYPES = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
                "min_p": torch.float32, "seed": torch.int64, "counter": torch.int64}
LOGIT_DTYPES = tuple(CTYPES)  # float32, float16, bfloat16
_MASK64 = (1 << 64) - 1


def _sample_regions(sig: OpSig, rect):
    """Tile rows b0…b1 read those rows of logits, whole, and those entries of each parameter."""
    (rows,) = rect
    return [(rows, (0, sig.in_shapes[0][1]))] + [(rows,)] * len(PARAM_DTYPES)


def _sample_cpu(sig: OpSig, rect, xs):
    from mpk.engine.sampling import sample

    logits, temperature, top_k, top_p, min_p, seed, counter = xs
    seeds = [int(s) & _MASK64 for s in seed.tolist()]
    return sample(logits, temperature, top_k, top_p, min_p, seeds, counter.tolist()).to(sig.out_dtype)


def _logits_word(op: OpInfo) -> tuple[str, int]:
    """The logits' C type and the elements in one of the task's 16-byte loads."""
    ctype = CTYPES[op.inputs[0].dtype]
    return ctype, 16 // DTYPE_SIZE[ctype]


def _check(op: OpInfo) -> None:
    """What sample_rows assumes: logits rows contiguous in whole 16-byte words."""
    logits = op.inputs[0]
    if logits.dtype not in CTYPES:
        raise op.error(f"logits are {str(logits.dtype)[6:]}; the CUDA task takes float32, float16 or bfloat16")
    _, vec = _logits_word(op)
    check_contiguous(op, "logits", logits, vec)
    if logits.shape[-1] % vec:
        raise op.error(f"a vocabulary of {logits.shape[-1]} logits; the CUDA task reads rows in 16-byte words, so "
                       f"it needs a multiple of {vec} ({str(logits.dtype)[6:]}): pad the logits with -inf")


SAMPLE_GPU = GpuSpec(task=lambda op: f"mpk::sample_rows<{_logits_word(op)[0]}>", check=_check,
                     vector_inputs=lambda op: (0,))


register(OpDef(
    kind="sample", type_id=18, input_regions=_sample_regions, cpu=_sample_cpu, gpu=SAMPLE_GPU,
    # a row of a vocabulary is a task's work by itself (several passes over it in one CTA)
    min_tile_elems=1,
    doc="tokens [B] = mpk.engine.sampling.sample(logits [B, V], temperature, top_k, top_p, min_p, seed, "
        "counter) (per-row parameters, [B] each)",
))
