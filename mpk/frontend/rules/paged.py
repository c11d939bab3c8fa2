"""Rules for attention over the paged KV cache: ``mpk.rope_append`` (qk-norm, RoPE and the KV
append, in place) and ``mpk.paged_attention`` (split-KV partials and their ⊕ merge), in the
decode form and the ragged one (``qo_indptr``: prefill, mixed batches; mpk.ops.paged)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles
from mpk.frontend.values import Unsupported
from mpk.ir.views import View

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


def _whole_input(L, v: View, what: str) -> View:
    """The identity view of a graph input: ops that write the paged cache in place need the
    caller's tensor itself (a view of it, or an intermediate, would lose the writes)."""
    buf = L.graph.buffers[v.buffer]
    if buf.role != "input":
        raise Unsupported(f"{what} must be a graph input passed whole (got {buf.name!r}, computed inside the graph)")
    if v.steps:
        raise Unsupported(f"{what} must be a graph input passed whole (got a view of {buf.name!r})")
    return v


@dataclass(frozen=True)
class DeferredRope:
    """A rope_append not emitted yet: its q feeds only a paged attention, which runs it inside
    its own tasks (rope_attn_partial)."""

    inputs: tuple
    attrs: dict
    shape: tuple[int, int, int]
    dtype: torch.dtype

    def emit(self, L) -> View:
        """The rope_append after all (the attention reads other tables than it did)."""
        return L.emit("rope_append", list(self.inputs), self.attrs, shape=self.shape, dtype=self.dtype)


MAX_FUSED_GROUP = 6  # cuda/mpk_tasks/paged_attention.cuh: the G q heads + k + v, one warp each


def _q_only_attended(node, layer: int, group: int) -> bool:
    """The q output of the (decode-form) rope_append ``node`` is read by exactly one decode-form
    paged attention, of the same layer, whose group fits the fused task."""
    q_nodes = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    users = [u for q in q_nodes for u in q.users]
    if len(q_nodes) != 1 or len(users) != 1 or users[0].target is not mpk_ops.paged_attention.default:
        return False
    attn = users[0]
    q_arg = attn.args[0] if attn.args else attn.kwargs.get("q")
    attn_layer = attn.args[5] if len(attn.args) > 5 else attn.kwargs.get("layer")
    ragged = (attn.args[8] if len(attn.args) > 8 else attn.kwargs.get("qo_indptr")) is not None
    return q_arg is q_nodes[0] and attn_layer == layer and group <= MAX_FUSED_GROUP and not ragged


def _rope_append(L, node, qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, q_norm, k_norm,
                 layer, heads, kv_heads, eps, qo_indptr=None):
    from mpk.frontend.fused_ops import rope_append_attrs

    cache_val = node.kwargs["_all_bases"][0].meta["val"]
    qkv_val = node.kwargs["qkv"].meta["val"]
    try:
        attrs = rope_append_attrs(qkv_val, cache_val, node.kwargs["kv_indptr"].meta["val"], kv_indices,
                                  kv_last_page_len, q_norm, k_norm, layer, heads, kv_heads, eps,
                                  None if qo_indptr is None else node.kwargs["qo_indptr"].meta["val"])
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    ins = [qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, _whole_input(L, kv_cache, "kv_cache")]
    ins += [q_norm, k_norm] if q_norm is not None else []
    ins += [qo_indptr] if qo_indptr is not None else []
    if (kv_cache.buffer, layer) in L.attended:
        raise Unsupported(f"rope_append writes layer {layer} of a cache that an earlier paged_attention of this "
                          "graph reads; append before attending")
    shape = (qkv.shape[0], heads, attrs["head_dim"])
    # the ragged form is never fused: a row attends to k/v that other rows append, in other tiles
    if L.fuse_rope_attention and qo_indptr is None and _q_only_attended(node, layer, heads // kv_heads):
        q = DeferredRope(tuple(ins), attrs, shape, qkv_val.dtype)
        L.appended_q[(kv_cache.buffer, layer)] = q
    else:
        q = L.emit("rope_append", ins, attrs, shape=shape, dtype=qkv_val.dtype)
        L.appended_q[(kv_cache.buffer, layer)] = q.buffer
    return q


# custom ops that mutate graph inputs, lowered to an op writing them in place; a rule returns
# the op's output (the mutated inputs' new values are the inputs themselves)
MUTATING_OPS = {mpk_ops.rope_append.default: _rope_append}


@handles(torch.ops.higher_order.auto_functionalized_v2)
def _auto_functionalized(L, node, op, **kwargs):
    """A custom op that mutates its arguments, functionalized by AOTAutograd. mpk runs the
    mutation in place, so the functional 'new value' of each mutated base is the base itself."""
    if op not in MUTATING_OPS:
        raise Unsupported(f"{op} mutates its inputs and has no in-place lowering")
    bases = kwargs.pop("_all_bases")
    for key in [k for k in kwargs if k.startswith("_") and k.endswith("_base_index")]:
        kwargs[key[1:-len("_base_index")]] = bases[kwargs.pop(key)]
    views = sorted(k for k in kwargs if k.startswith("_"))
    if views:  # the op mutates a view of its base (slice/alias metadata): not lowered
        raise Unsupported(f"{op} mutates a view of its input ({views}); pass the whole cache tensor")
    return (MUTATING_OPS[op](L, node, **kwargs), *bases)


def _fake(node, index: int, name: str):
    """The fake tensor of argument ``index`` (keyword ``name``) of the call ``node``."""
    return (node.args[index] if len(node.args) > index else node.kwargs[name]).meta["val"]


@handles(mpk_ops.paged_attention.default)
def _paged_attention(L, node, q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer, scale, num_splits,
                     qo_indptr=None):
    from mpk.frontend.fused_ops import default_splits, paged_attention_dims
    from mpk.ops.paged import DECODE_ROWS, MIN_CHUNK, plan_size, rows_per_tile

    try:  # (the page table's fake tensors: the ragged form's checks compare dtypes, which views lack)
        page_size, _, KV = paged_attention_dims(q, kv_cache, _fake(node, 2, "kv_indptr"), kv_indices,
                                                kv_last_page_len, layer, num_splits,
                                                None if qo_indptr is None else _fake(node, 8, "qo_indptr"))
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    B, H, D = q.shape  # (ragged: B counts token rows)
    cache = _whole_input(L, kv_cache, "kv_cache")
    if isinstance(q, DeferredRope) and (qo_indptr is not None or
                                        tuple(q.inputs[2:6]) != (kv_indptr, kv_indices, kv_last_page_len, cache)):
        rope = q  # other page tables or another cache than the append's: the two stay apart
        q = rope.emit(L)
        L.appended_q[(rope.inputs[5].buffer, layer)] = q.buffer
    batch = B if qo_indptr is None else kv_last_page_len.shape[0]
    # ragged: a tile holds rows_per_tile rows, so the chunks are sized to blocks of rows
    rows = 1 if qo_indptr is None else rows_per_tile(B, H // KV)
    capacity = kv_indices.shape[0] * page_size // max(1, batch)  # positions per sequence
    C = num_splits or default_splits(-(-B // rows), KV, capacity, L.num_workers)
    if qo_indptr is not None and not num_splits and B <= DECODE_ROWS and kv_indices.shape[0] * page_size >= 2 * MIN_CHUNK:
        # a batch of decodes: room for a long sequence's items beside the others' (attn_plan),
        # whose lengths the grid cannot know (one may hold most of the pages)
        C = max(C, 2)
    attrs = dict(layer=layer, scale=float(scale), page_size=page_size)
    # The cache is written in place by rope_append, invisibly to the dependency analysis; what
    # orders attention after the append is reading the q that same rope_append wrote (the tile
    # that appends kv head j also writes query head j·G, which every tile of kv head j reads).
    key = (cache.buffer, layer)
    # one chunk per sequence: ⊕ over one state is that state, so the tasks write the output
    # ([B, KV, G, D], viewed as [B, H, D]) and there is no merge op
    final = C == 1
    shape = (B, KV, H // KV, D) if final else (B, KV, C, H // KV, D + 1)
    dtype = L.meta().dtype if final else torch.float32
    attrs["final"] = final
    if qo_indptr is not None:
        attrs |= {"ragged": True, "rows": rows}

    def merged(states: View) -> View:
        return states.then(("reshape", (B, H, D))) if final else \
            L.emit("attn_merge", [states], {}, shape=(B, H, D), dtype=L.meta().dtype)

    if isinstance(q, DeferredRope):  # the append runs inside the attention tasks
        L.attended.add(key)
        return merged(L.emit("rope_attn_partial", list(q.inputs), {**q.attrs, **attrs}, shape=shape, dtype=dtype))
    appended = L.appended_q.get(key)
    if appended is not None and (appended != q.buffer or q.steps):
        raise Unsupported(f"paged_attention over layer {layer} must read the q returned by that layer's "
                          "rope_append (which appends the step's k/v); nothing else orders it after the append")
    L.attended.add(key)
    tables = [kv_indptr, kv_indices, kv_last_page_len] + ([qo_indptr] if qo_indptr is not None else [])
    if qo_indptr is None or final:
        return merged(L.emit("attn_partial", [q, cache, *tables], attrs, shape=shape, dtype=dtype))
    # ragged with chunks: the balanced split, its plan made once per step (every layer's
    # attention reads the same page table)
    blocks = -(-B // rows)
    plan_key = ("attn_plan", kv_indptr, kv_last_page_len, qo_indptr, B, rows, C)
    plan = L.shared.get(plan_key)
    if plan is None:
        plan = L.emit("attn_plan", [kv_indptr, kv_last_page_len, qo_indptr],
                      dict(tokens=B, rows=rows, chunks=C, target=max(1, L.num_workers // KV), page_size=page_size),
                      shape=(plan_size(B, rows, C),), dtype=torch.int32)
        L.shared[plan_key] = plan
    attrs["balanced"] = True
    states = L.emit("attn_partial", [q, cache, *tables, plan], attrs, shape=(blocks * rows, KV, C, H // KV, D + 1),
                    dtype=torch.float32)
    return L.emit("attn_merge", [states, plan], {"rows": rows}, shape=(B, H, D), dtype=L.meta().dtype)
