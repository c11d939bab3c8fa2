"""Row-wise op kinds: each output row needs its whole input row (the last dim).

``reduce`` (sum / mean / amax / argmax / amin / argmin over the last dim), ``softmax`` (or its
log), ``cumsum``, ``sort`` (the indices of a row's first k entries in order), ``layer_norm``,
``rms_norm`` and ``rope`` (rotate-half rotary embedding). Tiles split rows, never the last dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.ops.gpu import CTYPES, DTYPE_SIZE, ELEMENT_CTYPES, GpuSpec, OpInfo, all_inputs
from mpk.ops.registry import OpDef, OpSig, all_but_last, register, rows_region

# A row at least this long is a task's work by itself: its reduce tiles hold one row each, and
# the CUDA tasks give such a row (contiguous, in 16-byte words) the whole CTA
# (cuda/mpk_tasks/rows.cuh: reduce_rows, softmax_rows) — a vocabulary of logits, where one warp
# per row with scalar loads keeps too few bytes in flight.
LONG_ROW = 4096

REDUCE_FNS = {
    "sum": lambda x, k: torch.sum(x, dim=-1, keepdim=k),
    "mean": lambda x, k: torch.mean(x, dim=-1, keepdim=k),
    "amax": lambda x, k: torch.amax(x, dim=-1, keepdim=k),
    "argmax": lambda x, k: torch.argmax(x, dim=-1, keepdim=k),
    "amin": lambda x, k: torch.amin(x, dim=-1, keepdim=k),
    "argmin": lambda x, k: torch.argmin(x, dim=-1, keepdim=k),
}


# --- the CUDA side (cuda/mpk_tasks/rows.cuh, sort.cuh) ------------------------------------------

NORM_VECS = 4  # rows.cuh: kNormVecs (8-element vectors per thread, 256 threads)
_REDUCE_IDS = {name: i for i, name in enumerate(REDUCE_FNS)}


def row_vector_ctype(op: OpInfo) -> str | None:
    """The element type of a reduce or softmax op's CTA-per-row variant (rows.cuh: reduce_rows,
    softmax_rows) when its rows are long (≥ ``LONG_ROW`` elements) and read in whole 16-byte
    words — float, half or bfloat16, unit stride, the offset, the other strides and the length
    multiples of a word (and, for softmax, an output of one of those types); else None, and the
    op's task is the general one-warp-per-row form."""
    x = op.inputs[0]
    ctype = CTYPES.get(x.dtype)
    if ctype is None or x.ndim == 0:
        return None
    vec = 16 // DTYPE_SIZE[ctype]
    ok = (x.shape[-1] >= LONG_ROW and x.shape[-1] % vec == 0 and x.strides[-1] == 1 and x.offset % vec == 0
          and all(st % vec == 0 for n, st in zip(x.shape[:-1], x.strides[:-1]) if n > 1))
    if op.kind == "softmax":
        ok = ok and op.out_dtype in CTYPES
    return ctype if ok else None


def _row_vector_inputs(op: OpInfo) -> tuple[int, ...]:
    return all_inputs(op) if row_vector_ctype(op) else ()


def _reduce_task(op: OpInfo) -> str:
    """The typed CTA-per-row template where row_vector_ctype allows it (the reduction a template
    argument), else the general task."""
    ctype = row_vector_ctype(op)
    return f"mpk::reduce_rows<{ctype}, {_REDUCE_IDS[op.attrs['fn']]}>" if ctype else "mpk::task_reduce"


def _softmax_task(op: OpInfo) -> str:
    ctype = row_vector_ctype(op)
    return f"mpk::softmax_rows<{ctype}, {CTYPES.get(op.out_dtype)}>" if ctype else "mpk::task_softmax"


def _sort_task(op: OpInfo) -> str:
    """sort_rows over the input's element type (typed loads, no per-entry dtype switch)."""
    return f"mpk::sort_rows<{ELEMENT_CTYPES[op.inputs[0].dtype]}>"


def rms_norm_fast(op: OpInfo) -> bool:
    """The CTA-per-row bf16 norm of rows.cuh (variant 1) for 2-d bf16 rows with unit stride,
    16-byte alignment, a bf16 weight and length ≤ 8192 (a multiple of 8)."""
    if op.ndim != 2 or len(op.inputs) != 2 or op.attrs.get("norm_dtype") != "bfloat16":
        return False
    x, w = op.inputs
    n = x.shape[1]
    return (all(d == torch.bfloat16 for d in (x.dtype, w.dtype, op.out_dtype)) and x.ndim == 2 and w.ndim == 1
            and x.strides[1] == 1 and w.strides[0] == 1 and n % 8 == 0 and n <= NORM_VECS * 8 * 256
            and all(v % 8 == 0 for v in (x.offset, x.stride(0), w.offset)))


REDUCE_GPU = GpuSpec(params=lambda op: ([int(op.attrs["keepdim"]), _REDUCE_IDS[op.attrs["fn"]]], []),
                     task=_reduce_task, vector_inputs=_row_vector_inputs)
SOFTMAX_GPU = GpuSpec(params=lambda op: ([int(op.attrs.get("log", False))], []), task=_softmax_task,
                      vector_inputs=_row_vector_inputs)
SORT_GPU = GpuSpec(params=lambda op: ([int(op.attrs["descending"])], []), task=_sort_task, float64_exact=True)
LAYER_NORM_GPU = GpuSpec(params=lambda op: ([int(op.attrs["has_weight"]), int(op.attrs["has_bias"])],
                                            [op.attrs["eps"]]))
RMS_NORM_GPU = GpuSpec(
    params=lambda op: ([int(op.attrs["has_weight"]), op.dtype_code(getattr(torch, op.attrs["norm_dtype"]))],
                       [op.attrs["eps"]]),
    variant=lambda op: int(rms_norm_fast(op)), vector_inputs=lambda op: all_inputs(op) if rms_norm_fast(op) else ())


def _reduce_regions(sig: OpSig, rect):
    lead = rect[:-1] if sig.attrs["keepdim"] else rect
    (x_shape,) = sig.in_shapes
    return [tuple(lead) + ((0, x_shape[-1]),)]


def _reduce_cpu(sig: OpSig, rect, xs):
    x, fn = xs[0], sig.attrs["fn"]
    if x.dtype == torch.bool and fn.startswith("arg"):  # torch.max/min(bool, dim) give indices; argmax refuses bool
        x = x.to(torch.uint8)
    return REDUCE_FNS[fn](x, sig.attrs["keepdim"]).to(sig.out_dtype)


def _reduce_min_tile(sig: OpSig) -> int:
    return 1 if sig.in_shapes[0][-1] >= LONG_ROW else 8


register(OpDef(
    kind="reduce", type_id=10, input_regions=_reduce_regions, cpu=_reduce_cpu, gpu=REDUCE_GPU,
    min_tile_elems=_reduce_min_tile, doc="out = fn(x, dim=-1, keepdim)",
))


def _row_regions(sig: OpSig, rect):
    """First input row-wise; further inputs (weights, tables) are broadcast row-wise too."""
    return [rows_region(s, sig.out_shape, rect) for s in sig.in_shapes]


def _softmax_cpu(sig: OpSig, rect, xs):
    fn = torch.log_softmax if sig.attrs.get("log") else torch.softmax
    return fn(xs[0], dim=-1).to(sig.out_dtype)


register(OpDef(
    kind="softmax", type_id=11, input_regions=_row_regions, cpu=_softmax_cpu, gpu=SOFTMAX_GPU,
    splittable=all_but_last, min_tile_elems=256, doc="out = softmax(x, dim=-1), or its log where attrs['log']",
))


def _cumsum_cpu(sig: OpSig, rect, xs):
    return (torch.cumprod if sig.attrs.get("prod") else torch.cumsum)(xs[0], dim=-1).to(sig.out_dtype)


register(OpDef(
    kind="cumsum", type_id=16, input_regions=_row_regions, cpu=_cumsum_cpu,
    gpu=GpuSpec(params=lambda op: ([int(bool(op.attrs.get("prod")))], [])),
    splittable=all_but_last, min_tile_elems=256,
    doc="out = cumsum(x, dim=-1), or cumprod where attrs['prod'] (integers exactly, in 64 bits, wrapping as eager's)",
))


# Results a sort row keeps in shared memory (cuda/mpk_tasks/sort.cuh: kSortMax): a row of at most
# this many entries is sorted whole; a longer one gives at most this many (topk), selected first.
SORT_MAX = 2048


def _sort_cpu(sig: OpSig, rect, xs):
    order = torch.sort(xs[0], dim=-1, descending=sig.attrs["descending"], stable=True).indices
    return order[..., : sig.out_shape[-1]].to(sig.out_dtype)


register(OpDef(
    kind="sort", type_id=17, input_regions=_row_regions, cpu=_sort_cpu, gpu=SORT_GPU,
    splittable=all_but_last, min_tile_elems=1,
    doc="out = the indices of x's first k entries (k = out.shape[-1]) in a stable sort of each row, "
        "descending where attrs['descending']; NaN sorts as the largest value",
))


def _layer_norm_cpu(sig: OpSig, rect, xs):
    x, *wb = xs
    a = sig.attrs
    w = wb[0] if a["has_weight"] else None
    b = wb[-1] if a["has_bias"] else None
    return F.layer_norm(x, (x.shape[-1],), w, b, a["eps"]).to(sig.out_dtype)


register(OpDef(
    kind="layer_norm", type_id=12, input_regions=_row_regions, cpu=_layer_norm_cpu, gpu=LAYER_NORM_GPU,
    splittable=all_but_last, min_tile_elems=256,
    doc="out = layer_norm(x, [weight], [bias], eps) over the last dim",
))


def _rms_norm_cpu(sig: OpSig, rect, xs):
    a = sig.attrs
    x = xs[0].to(getattr(torch, a["compute_dtype"]))
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a["eps"])).to(getattr(torch, a["norm_dtype"]))
    if a["has_weight"]:
        y = y * xs[1]
    return y.to(sig.out_dtype)


register(OpDef(
    kind="rms_norm", type_id=13, input_regions=_row_regions, cpu=_rms_norm_cpu, gpu=RMS_NORM_GPU,
    splittable=all_but_last, min_tile_elems=256,
    doc="y = x·rsqrt(mean(x²)+eps) in compute_dtype, cast to norm_dtype, times [weight]",
))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x[half:], x[:half]) over the last dim: RoPE's rotation partner of each element."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_cpu(sig: OpSig, rect, xs):
    x, cos, sin = xs
    return (x * cos + rotate_half(x) * sin).to(sig.out_dtype)


register(OpDef(
    kind="rope", type_id=14, input_regions=_row_regions, cpu=_rope_cpu, gpu=GpuSpec(),
    splittable=all_but_last, min_tile_elems=256,
    doc="out = x·cos + rotate_half(x)·sin (rotate_half(x) = cat(-x[half:], x[:half]))",
))
