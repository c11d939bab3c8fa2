"""The weight rings' streams (mpk/megakernel/weight_ring.py) on the CPU: the slots of a task tile
its weights exactly once, and a Python replay of linear_ring's consumption order — passes,
groups of 256 k, 32-row slots — computes x @ Wᵀ (and the gate·up SiLU·mul) from the slots'
bytes alone, so the descriptors and the order linear_ring reads them in agree."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mpk.megakernel import weight_ring as wr


def _slot_data(w: np.ndarray, d) -> np.ndarray:
    """A slot as its tensor copies fill it: ``box_rows`` rows × boxes·64 k of the weight ``w``
    [rows, K] from (x, y), zeros past either extent (the maps' out-of-bounds fill)."""
    rows, k = int(d["box_rows"]), 64 * int(d["boxes"])
    y, x = int(d["y"]), int(d["x"])
    out = np.zeros((rows, k))
    part = w[y: y + rows, x: x + k]
    out[: part.shape[0], : part.shape[1]] = part
    return out


def _replay(spec: dict, lo: int, hi: int, w: np.ndarray, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """linear_ring's loop over the stream: per pass, per 256-k group, its 1 or 2 slots in order;
    a slot's rows are the pass's output columns (gate·up: block 0 gate, block 1 up)."""
    K, glu = spec["K"], spec["glu"]
    width = 32 if glu else 64
    groups = -(-K // 256)
    xz = np.zeros((x.shape[0], 256 * groups))
    xz[:, :K] = x  # x past K is zero (linear_ring loads none)
    out = np.zeros((x.shape[0], hi - lo))
    i = 0
    for n0 in range(lo, hi, width):
        cols = min(width, hi - n0)
        blocks = 2 if glu or cols > 32 else 1
        acc = np.zeros((2, 32, x.shape[0]))
        for kc in range(groups):
            for b in range(blocks):
                data = _slot_data(w, slots[i])
                assert int(slots[i]["x"]) == 256 * kc
                i += 1
                acc[b, : data.shape[0]] += data @ xz[:, 256 * kc: 256 * kc + data.shape[1]].T
        if glu:
            gate, up = acc[0, :cols].T, acc[1, :cols].T
            out[:, n0 - lo: n0 - lo + cols] = gate / (1 + np.exp(-gate)) * up
        else:
            out[:, n0 - lo: n0 - lo + cols] = np.concatenate([acc[0], acc[1]])[:cols].T
    assert i == len(slots), "the replay read every slot"
    return out


@pytest.mark.parametrize("trial", range(6))
def test_task_slots_replay_the_product(trial):
    rng = random.Random()
    K = 32 * rng.randint(1, 40)  # below, at and off multiples of 64 and 256
    N = rng.randint(1, 300)
    glu = rng.random() < 0.5
    w = np.random.randn(2 * N if glu else N, K)
    lo = rng.randint(0, N - 1)
    hi = rng.randint(lo + 1, N)
    spec = {"weight": (3, 0, K, K, w.shape[0]), "K": K, "N": N, "glu": glu}
    slots = wr.task_slots(spec, lo, hi, weight_index=5)
    heights = slots["box_rows"]
    assert np.isin(heights, wr.BOX_HEIGHTS).all()
    assert (slots["map"] == 4 * 5 + np.searchsorted(wr.BOX_HEIGHTS, heights)).all()
    assert ((slots["boxes"] >= 1) & (slots["boxes"] <= 4)).all() and (slots["x"] + 64 * (slots["boxes"] - 1) < K).all()
    x = np.random.randn(rng.randint(1, 16), K)
    got = _replay(spec, lo, hi, w, x, slots)
    h = x @ w.T
    ref = h[:, lo:hi]
    if glu:
        gate, up = h[:, lo:hi], h[:, N + lo: N + hi]
        ref = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    # every weight element of the task in exactly one slot's first ``rows`` rows; a box reads at
    # most 7 rows past its block (its height is the block's rows rounded up to 8)
    need = np.zeros(w.shape, bool)
    need[lo:hi] = True
    if glu:
        need[N + lo: N + hi] = True
    seen = np.zeros(w.shape, np.int32)
    for d in slots:
        y, x0, rows = int(d["y"]), int(d["x"]), int(d["box_rows"])
        block = need[y: y + rows, x0: x0 + 64 * int(d["boxes"])]
        valid = int(block.any(axis=1).sum())
        assert rows - valid < 8
        seen[y: y + valid, x0: x0 + 64 * int(d["boxes"])] += 1
    assert np.array_equal(seen > 0, need) and seen.max() == 1


def test_worker_streams_cover_each_linear_task_once():
    """A one-layer qwen3-1.7b decode step's streams over 128 round-robin workers: each worker's
    range is the concatenation of its ring tasks' slots in its AOT order, then its first
    DESC_BLOCK descriptors again; the slots of all workers tile every ring op's weights once."""
    import argparse

    from mpk.cli import PRESETS
    from mpk.inspection import compile_module
    from mpk.megakernel.codegen import ring_ops

    ns = argparse.Namespace(layers=1, batch=1, cache_len=100, seq=1)
    model, args = PRESETS["qwen3-1.7b-paged"](ns)
    t = compile_module(model, args, {"num_workers": 128}).tables
    ops = ring_ops(t)
    kinds = sorted(t.meta["ops"][i]["kind"] for i in ops)
    assert kinds == ["matmul"] * 5  # qkv, o, gate·up, down, lm_head (no pattern fusion outside Dynamo)
    workers = 7  # few workers: several ring tasks each
    order = np.arange(len(t.tasks), dtype=np.int32)
    per_worker = [order[w::workers] for w in range(workers)]
    table, offsets, weights = wr.worker_streams(t, per_worker, ops)
    assert len(weights) == len(ops)  # five projections, five weights
    assert len(offsets) == workers + 1 and offsets[-1] == len(table)
    weight_bytes = 0
    for w in range(workers):
        mine = [int(task) for task in per_worker[w] if int(t.tasks["op"][task]) in ops]
        specs = [wr._linear_spec(t, int(t.tasks["op"][k])) for k in mine]
        expect = [wr.task_slots(spec, *wr._tile_columns(t, int(t.tasks["op"][k]), int(t.tasks["tile"][k])),
                                weights.index(spec["weight"])) for spec, k in zip(specs, mine)]
        stream = np.concatenate(expect)
        got = table[offsets[w]: offsets[w + 1]]
        assert np.array_equal(got[: len(stream)], stream)
        assert np.array_equal(got[len(stream):], stream[np.arange(wr.DESC_BLOCK) % len(stream)])
        weight_bytes += int((stream["box_rows"].astype(np.int64) * stream["boxes"] * 128).sum())
    expect_bytes = 0
    for op in ops:
        spec = wr._linear_spec(t, op)
        expect_bytes += 2 * spec["K"] * spec["N"] * (2 if spec["glu"] else 1)
    # boxes cover all of it, reading past a tile's last row only up to the next multiple of 8
    assert expect_bytes <= weight_bytes <= expect_bytes * 1.05


def test_ring_fits_the_shared_memory_it_is_given():
    for free in (0, wr.ring_bytes(wr.MIN_SLOTS) - 1, wr.ring_bytes(7), 227 * 1024 - 44 * 1024, 10 ** 7):
        n = wr.ring_slots_that_fit(free)
        assert n == 0 or (wr.MIN_SLOTS <= n <= wr.MAX_SLOTS and wr.ring_bytes(n) <= free)
        assert n == wr.MAX_SLOTS or wr.ring_bytes(n + 1) > free or n == 0
