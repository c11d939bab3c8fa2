"""``attention``: softmax(q·kᵀ·scale + mask)·v with GQA and top-left causal masking.

q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], Hq a multiple of Hkv (query head h
reads kv head h // (Hq/Hkv)); optional additive or boolean mask broadcast to [B, Hq, Sq, Sk].
Causal follows torch's ``is_causal``: query row i sees keys j <= i. Tiles split batch, heads
and query rows; a tile of rows [s0, s1) of a causal op reads only keys [0, s1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.ops.gpu import GpuSpec, OpInfo
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register

MAX_HEAD_DIM = 512  # cuda/mpk_tasks/attention.cuh: kMaxHeadDim (the generated source static_asserts it)


def _kv_rows(sig: OpSig, rect) -> tuple[int, int]:
    sk = sig.in_shapes[1][-2]
    return (0, min(sk, rect[2][1])) if sig.attrs["causal"] else (0, sk)


def _attention_regions(sig: OpSig, rect):
    q_shape, k_shape, v_shape, *mask = sig.in_shapes
    group = q_shape[1] // k_shape[1]
    (b0, b1), (h0, h1), rows, _ = rect
    kv_heads = (h0 // group, (h1 - 1) // group + 1)
    kv_rows = _kv_rows(sig, rect)
    regions = [
        ((b0, b1), (h0, h1), rows, (0, q_shape[-1])),
        ((b0, b1), kv_heads, kv_rows, (0, k_shape[-1])),
        ((b0, b1), kv_heads, kv_rows, (0, v_shape[-1])),
    ]
    if mask:
        scores_shape = tuple(sig.out_shape[:3]) + (k_shape[-2],)
        regions.append(broadcast_region(mask[0], scores_shape, rect[:3] + (kv_rows,)))
    return regions


def _attention_cpu(sig: OpSig, rect, xs):
    q, k, v, *mask = xs
    group = sig.in_shapes[0][1] // sig.in_shapes[1][1]
    (h0, h1), (s0, s1) = rect[1], rect[2]
    kv_index = torch.arange(h0, h1) // group - h0 // group
    k, v = k[:, kv_index], v[:, kv_index]
    bias = mask[0] if mask else None  # torch allows a mask or is_causal, never both
    if sig.attrs["causal"]:
        bias = torch.arange(k.shape[-2]).unsqueeze(0) <= torch.arange(s0, s1).unsqueeze(-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=sig.attrs["scale"])
    return out.to(sig.out_dtype)


def _attention_order(sig: OpSig) -> list[int]:
    return [1, 0, 2]


def _attention_check(op: OpInfo) -> None:
    q, v = op.inputs[0], op.inputs[2]
    if max(q.shape[3], v.shape[3]) > MAX_HEAD_DIM:
        raise op.error(f"head dim {q.shape[3]}/{v.shape[3]} exceeds the CUDA attention task's {MAX_HEAD_DIM}")


register(OpDef(
    kind="attention", type_id=30, input_regions=_attention_regions, cpu=_attention_cpu,
    gpu=GpuSpec(params=lambda op: ([int(op.attrs["causal"])], [op.attrs["scale"]]), check=_attention_check),
    splittable=lambda sig: (True, True, True, False), split_order=_attention_order,
    min_tile_elems=1, data_dependent=True,
    doc="softmax(q kᵀ·scale + mask) v, GQA, top-left causal",
))
