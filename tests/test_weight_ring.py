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


def _slot_data(w_bytes: np.ndarray, d) -> np.ndarray:
    """A slot's rows as the bulk copies fill them: ``rows`` × ``words``·8 bf16 values (as float32)."""
    rows, n = int(d["rows"]), int(d["words"]) * 16
    out = np.stack([w_bytes[int(d["offset"]) + r * int(d["stride"]): int(d["offset"]) + r * int(d["stride"]) + n]
                    for r in range(rows)])
    return torch.from_numpy(out.copy()).view(torch.bfloat16).float().numpy()


def _replay(spec: dict, lo: int, hi: int, w_bytes: np.ndarray, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """linear_ring's loop over the stream: per pass, per 256-k group, its 1 or 2 slots in order;
    a slot's rows are the pass's output columns (gate·up: block 0 gate, block 1 up)."""
    K, glu = spec["K"], spec["glu"]
    width = 32 if glu else 64
    groups = -(-K // 256)
    out = np.zeros((x.shape[0], hi - lo))
    i = 0
    for n0 in range(lo, hi, width):
        cols = min(width, hi - n0)
        blocks = 2 if glu or cols > 32 else 1
        acc = np.zeros((2, 32, x.shape[0]))
        for kc in range(groups):
            for b in range(blocks):
                data = _slot_data(w_bytes, slots[i])
                i += 1
                k0 = 256 * kc
                acc[b, : data.shape[0]] += data.astype(np.float64) @ x[:, k0: k0 + data.shape[1]].T
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
    K = 32 * rng.randint(1, 40)  # below, at and off multiples of 256
    N = rng.randint(1, 300)
    glu = rng.random() < 0.5
    ldw = K + 8 * rng.randint(0, 3)  # weight rows may be padded
    offset = 8 * rng.randint(0, 5)
    rows_w = 2 * N if glu else N
    w = 0.1 * torch.randn(offset + rows_w * ldw)
    w_bytes = w.bfloat16().view(torch.uint8).numpy()
    wmat = w.bfloat16().float()[offset:].reshape(rows_w, ldw)[:, :K].double().numpy()
    lo = rng.randint(0, N - 1)
    hi = rng.randint(lo + 1, N)
    spec = {"buffer": 3, "offset": offset, "ldw": ldw, "K": K, "N": N, "glu": glu}
    slots = wr.task_slots(spec, lo, hi)
    assert (slots["rows"] <= wr.RING_ROWS).all() and (slots["words"] * 8 <= wr.RING_K).all()
    assert (slots["offset"] % 16 == 0).all() and (slots["stride"] == 2 * ldw).all() and (slots["buffer"] == 3).all()
    x = np.random.randn(rng.randint(1, 16), K)
    got = _replay(spec, lo, hi, w_bytes, x, slots)
    h = x @ wmat.T
    ref = h[:, lo:hi]
    if glu:
        gate, up = h[:, lo:hi], h[:, N + lo: N + hi]
        ref = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    # every weight element of the task read once: the slots' byte ranges are disjoint and cover it
    touched = np.zeros(len(w_bytes), np.int32)
    for d in slots:
        for r in range(int(d["rows"])):
            start = int(d["offset"]) + r * int(d["stride"])
            touched[start: start + 16 * int(d["words"])] += 1
    expect = np.zeros_like(touched)
    for row in [*range(lo, hi), *(range(N + lo, N + hi) if glu else ())]:
        start = 2 * (offset + row * ldw)
        expect[start: start + 2 * K] = 1
    assert np.array_equal(touched, expect)


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
    table, offsets = wr.worker_streams(t, per_worker, ops)
    assert len(offsets) == workers + 1 and offsets[-1] == len(table)
    weight_bytes = 0
    for w in range(workers):
        mine = [int(task) for task in per_worker[w] if int(t.tasks["op"][task]) in ops]
        expect = [wr.task_slots(wr._linear_spec(t, int(t.tasks["op"][k])),
                                *wr._tile_columns(t, int(t.tasks["op"][k]), int(t.tasks["tile"][k]))) for k in mine]
        stream = np.concatenate(expect)
        got = table[offsets[w]: offsets[w + 1]]
        assert np.array_equal(got[: len(stream)], stream)
        assert np.array_equal(got[len(stream):], stream[np.arange(wr.DESC_BLOCK) % len(stream)])
        weight_bytes += int((stream["rows"].astype(np.int64) * stream["words"] * 16).sum())
    expect_bytes = 0
    for op in ops:
        spec = wr._linear_spec(t, op)
        expect_bytes += 2 * spec["K"] * spec["N"] * (2 if spec["glu"] else 1)
    assert weight_bytes == expect_bytes


def test_ring_fits_the_shared_memory_it_is_given():
    for free in (0, wr.ring_bytes(wr.MIN_SLOTS) - 1, wr.ring_bytes(7), 227 * 1024 - 44 * 1024, 10 ** 7):
        n = wr.ring_slots_that_fit(free)
        assert n == 0 or (wr.MIN_SLOTS <= n <= wr.MAX_SLOTS and wr.ring_bytes(n) <= free)
        assert n == wr.MAX_SLOTS or wr.ring_bytes(n + 1) > free or n == 0
