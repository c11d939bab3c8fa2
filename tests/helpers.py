"""Shared test helpers: compile FX graphs straight to tables, random partitions, an
element-level dependency oracle independent of the compiler's rect analysis."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mpk.compiler import compile_graph
from mpk.compiler.partition import op_sig
from mpk.compiler.tables import Tables
from mpk.frontend import fuse_patterns, lower
from mpk.ops import get_op


def trace_graph(fn, args):
    """fn(*args) → OpGraph through the real frontend (make_fx gives the ATen graph)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    fuse_patterns(gm)
    return lower(gm)


def random_partition(graph, rng: random.Random, max_tiles: int = 5) -> dict[str, list[int]]:
    part = {}
    for op in graph.ops:
        sig = op_sig(graph, op)
        splittable = get_op(op.kind).splittable(sig)
        part[op.name] = [rng.randint(1, min(n, max_tiles)) if s else 1 for n, s in zip(sig.out_shape, splittable)]
    return part


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64, out64 = ref.double(), out.double()
    return float((out64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def _element_ids(tables: Tables, view: int) -> np.ndarray:
    v = tables.views[view]
    nd = int(v["ndim"])
    shape = [int(s) for s in v["shape"][:nd]]
    strides = [int(s) for s in v["strides"][:nd]]
    idx = np.full(shape, int(v["offset"]), dtype=np.int64)
    for d in range(nd):
        ar = np.arange(shape[d]) * strides[d]
        idx = idx + ar.reshape([-1 if i == d else 1 for i in range(nd)])
    return idx


def task_reachability(tables: Tables) -> list[set[int]]:
    """For every task, the set of tasks that must finish before it starts (via events)."""
    n = len(tables.tasks)
    anc: list[set[int]] = [set() for _ in range(n)]
    ev_anc: dict[int, set[int]] = {}
    trig_of: dict[int, list[int]] = {}
    for t in range(n):
        trig_of.setdefault(int(tables.tasks["trig_event"][t]), []).append(t)
    # tasks are in topological (linear) order: an event's triggers all precede its range
    for t in range(n):
        e = int(tables.tasks["dep_event"][t])
        if e not in ev_anc:
            s: set[int] = set()
            triggers = trig_of.get(e, [])
            # an event firing before all its triggers arrived guarantees none of them ran
            if int(tables.events["num_triggers"][e]) >= len(triggers):
                for p in triggers:
                    s |= anc[p] | {p}
            ev_anc[e] = s
        anc[t] = ev_anc[e]
    return anc


def check_dependencies(tables: Tables) -> int:
    """Oracle: every (writer, reader) pair whose elements overlap is ordered by events.
    Works on element ids from the tables' strided views, not on the compiler's rects.
    Returns the number of overlapping pairs checked."""
    from mpk.megakernel.interpreter import Interpreter

    interp = Interpreter(tables, check_races=False, validate_tables=False)
    anc = task_reachability(tables)
    writes: dict[int, list[tuple[int, set[int]]]] = {}
    reads: list[tuple[int, int, set[int]]] = []
    for t, rec in enumerate(tables.tasks):
        if rec["op"] < 0:
            continue
        op = interp.ops[int(rec["op"])]
        rect = op.tile_rect(int(rec["tile"]))
        shape = op.sig.out_shape
        ids = np.arange(int(np.prod(shape))).reshape(shape)[tuple(slice(a, b) for a, b in rect)]
        writes.setdefault(op.output, []).append((t, set(ids.reshape(-1).tolist())))
        for v, region in zip(op.inputs, op.opdef.input_regions(op.sig, rect)):
            if region is None:
                continue
            el = _element_ids(tables, v)[tuple(slice(a, b) for a, b in region)]
            reads.append((t, int(tables.views[v]["buffer"]), set(el.reshape(-1).tolist())))
    checked = 0
    for t, buf, els in reads:
        for w, wels in writes.get(buf, []):
            if els & wels:
                checked += 1
                assert w in anc[t], f"task {t} reads elements task {w} writes, but no event path orders them"
    return checked


def compile_with(graph, partition=None, num_workers=8):
    return compile_graph(graph, num_workers=num_workers, partition=partition)


def random_decoder(config, seed: int, batch: int, seq: int):
    """A toy decoder with fresh random weights and a prefill batch: (model, ids, cos, sin)."""
    from mpk.models.toy import Decoder, randomize, rope_tables

    g = torch.Generator().manual_seed(seed)
    model = randomize(Decoder(config), g).eval()
    ids = torch.randint(0, config.vocab, (batch, seq), generator=g)
    cos, sin = rope_tables(config, torch.arange(seq))
    return model, ids, cos, sin


def random_decode_step(config, seed: int, batch: int = 2, cache_len: int = 9):
    """A toy decoder and one decode step over a random static cache of ``cache_len`` entries:
    (model, ids, cos, sin, past)."""
    from mpk.models.toy import Decoder, randomize, rope_tables

    g = torch.Generator().manual_seed(seed)
    model = randomize(Decoder(config), g).eval()
    past = [torch.randn(batch, config.kv_heads, cache_len, config.head_dim, generator=g)
            for _ in range(2 * config.layers)]
    ids = torch.randint(0, config.vocab, (batch, 1), generator=g)
    cos, sin = rope_tables(config, torch.tensor([cache_len]))
    return model, ids, cos, sin, past


def random_page_table(lens: list[int], page_size: int, g: torch.Generator, spare: int = 2):
    """A BSR page table for sequences of ``lens`` over shuffled pages (plus ``spare`` unused
    ones): (pages per sequence, kv_indptr, kv_indices, kv_last_page_len, number of pages)."""
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages, pos = [], 0
    for k in counts:
        pages.append(perm[pos: pos + k])
        pos += k
    indptr = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    indices = torch.tensor(sum(pages, []) + [0] * spare, dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    return pages, indptr, indices, last, num_pages


def dense_paged_attention(q, cache, lens, pages, page_size: int, layer: int, scale: float) -> torch.Tensor:
    """float64 softmax attention of q [B, H, D] over each sequence's cached positions, read
    position by position through the page list (GQA: head h uses kv head h // (H / KV))."""
    out = torch.empty(q.shape, dtype=torch.float64)
    B, H, _ = q.shape
    group = H // cache.shape[3]
    for b in range(B):
        t = torch.arange(lens[b])
        page, slot = torch.tensor(pages[b])[t // page_size], t % page_size
        k, v = cache[layer, 0, page, :, slot].double(), cache[layer, 1, page, :, slot].double()  # [n, KV, D]
        for h in range(H):
            p = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v[:, h // group]
    return out


def lockstep(runs, tokens: torch.Tensor, first_grow) -> list[torch.Tensor]:
    """Teacher-forced decode side by side: step t grows every run's cache (by ``first_grow`` at
    the first, then by one) and runs each ``(step, cache)`` on ``tokens[t]`` ([steps, batch]).
    (Feeding back an arg-max instead let a random model settle on one token at batch 1, so
    every step repeated the first one's logits.) Returns each run's stacked float logits, in
    order."""
    logits = [[] for _ in runs]
    with torch.no_grad():
        for t in range(tokens.shape[0]):
            for (step, kv), out in zip(runs, logits):
                kv.grow(first_grow if t == 0 else 1)
                out.append(step(tokens[t], *kv.args()).float())
    return [torch.stack(out) for out in logits]


def float32_twin(model):
    """A float32 copy of a DecoderLM (the same weights; its RoPE table computed in float32):
    the truth a bf16 run's rounding is measured against."""
    from mpk.models.llm import DecoderLM

    twin = DecoderLM(model.cfg, torch.float32, model.embed.device, model.cos_sin.shape[0], model.num_splits)
    twin.load_state_dict(model.state_dict())
    return twin


def against_eager_and_float32(model, step, batch: int, max_len: int, page_size: int, steps: int, first_grow):
    """``lockstep`` of the bf16 eager ``model`` (leading), the compiled ``step`` and a float32
    twin, each with its own cache; asserts the compiled logits as close to the twin's as the
    eager path's are (largest and median error relative to the largest |logit| within 1.5× the
    eager path's: bf16 rounding of different summation orders) and top-1 agreement ≥ 99% with
    the eager path where its logits are decisive (few positions may hold none). Returns the
    (eager, compiled) caches."""
    from mpk.models.llm import PagedKVCache
    from mpk.models.parity import compare_logits

    twin = float32_twin(model)
    kv_eager, kv_step = PagedKVCache(model, batch, max_len, page_size), PagedKVCache(model, batch, max_len, page_size)
    tokens = torch.randint(0, model.cfg.vocab, (steps, batch), device=model.embed.device)
    refs, outs, truth = lockstep([(model, kv_eager), (step, kv_step), (twin, PagedKVCache(twin, batch, max_len, page_size))],
                                 tokens, first_grow)
    ours, eager = compare_logits(outs, truth), compare_logits(refs, truth)
    assert ours["max_rel"] <= 1.5 * eager["max_rel"] and ours["median_rel"] <= 1.5 * eager["median_rel"], (ours, eager)
    stats = compare_logits(outs, refs)
    assert stats["decisive_share"] == 0 or stats["top1_decisive"] >= 0.99, stats
    return kv_eager, kv_step


def norm_fusions(options: dict, batch: int, hidden: int) -> tuple[bool, bool]:
    """(prologue, split) of a bf16 decode step compiled with ``options``: whether its RMSNorms
    run inside the projection after them (x fits the prologue's tile) and whether those after
    a residual projection are split between the projections around them (fuse_norm_stats:
    "auto" splits above NORM_SPLIT_MIN_BYTES of x, or all with the prologue off)."""
    from mpk.ops.linalg import NORM_SPLIT_MIN_BYTES, NORM_TILE_BYTES

    nbytes = batch * hidden * 2
    prologue = options.get("fuse_norm_prologue", True) and nbytes <= NORM_TILE_BYTES
    stats = options.get("fuse_norm_stats", "auto")
    return prologue, stats is True or (stats == "auto" and (nbytes > NORM_SPLIT_MIN_BYTES or not prologue))


def check_arguments_inside_storage(model, step, batch: int, page_size: int, steps: int) -> None:
    """Decode ``steps`` teacher-forced steps through the compiled ``step`` twice, on fresh
    tensors and on arguments that start inside a larger storage — each step's tokens a row of
    one [steps, batch] tensor, the KV cache the middle third of a tensor of random values —
    and assert the two runs' logits and caches bit-identical (the same kernel on the same
    values), the storage around the cache untouched."""
    from mpk.models.llm import PagedKVCache

    fresh, inside = PagedKVCache(model, batch, 32, page_size), PagedKVCache(model, batch, 32, page_size)
    n = inside.cache.numel()  # a multiple of head_dim: the slice stays 16-byte aligned
    storage = torch.randn(3 * n, device=inside.cache.device).to(inside.cache.dtype)
    around = storage.clone()
    inside.cache = storage[n: 2 * n].view(inside.cache.shape).zero_()
    tokens = torch.randint(0, model.cfg.vocab, (steps, batch), device=model.embed.device)
    with torch.no_grad():
        for t in range(steps):
            for kv in (fresh, inside):
                kv.grow([1 + 3 * b for b in range(batch)] if t == 0 else 1)
            ref = step(tokens[t].clone(), *fresh.args())
            row = tokens[t]
            assert row.storage_offset() == t * batch
            assert torch.equal(step(row, *inside.args()), ref), t
    assert torch.equal(inside.cache, fresh.cache)
    assert torch.equal(storage[:n], around[:n]) and torch.equal(storage[2 * n:], around[2 * n:])
