"""The weight rings' streams: what each worker's ring (``cuda/mpk_tasks/weight_ring.cuh``) copies,
slot by slot, in the order its linear tasks (``linear_ring`` in ``linalg.cuh``) read it.

A worker's AOT list is fixed before the launch, and the weights of its variant-1 linear tasks
are graph inputs that nothing in the kernel writes, so the host can lay out the worker's whole
weight stream ahead: one 16-byte descriptor per slot (up to 32 weight rows × 256 k, one bulk
copy per row). The device consumer walks the same order — this module and ``linear_ring``
must agree, and ``tests/test_weight_ring.py`` checks that the slots tile every task's weights
exactly once.
"""

from __future__ import annotations

import numpy as np

from mpk.compiler.tables import Tables

RING_ROWS = 32  # kRingRows: weight rows per slot
RING_K = 256  # kRingK: k elements of a row per slot
RING_ROW_BYTES = 2 * RING_K + 64  # kRingRowBytes
RING_SLOT_BYTES = RING_ROWS * RING_ROW_BYTES  # kRingSlotBytes
DESC_BLOCK = 16  # kRingDescBlock: descriptors per bulk copy; each stream's first block is repeated after it
MIN_SLOTS = 4  # a group of 2 slots must land while the 2 before it are read (linear_ring's refill lag)
MAX_SLOTS = 12

# mpk::RingDesc
DESC_DTYPE = np.dtype([("offset", "<u8"), ("stride", "<u4"), ("buffer", "<u2"), ("rows", "u1"), ("words", "u1")])
assert DESC_DTYPE.itemsize == 16


def _linear_spec(tables: Tables, op: int) -> dict:
    """What the stream needs of a variant-1 linear op: the weight buffer, its view's offset and
    row stride (elements), K, the output width N and whether it is a gate·up (SiLU·mul) op."""
    o = tables.ops[op]
    meta = tables.meta["ops"][op]
    a, b = (tables.views[int(x)] for x in tables.op_inputs[[o["first_input"], o["first_input"] + 1]])
    glu = meta["kind"] == "matmul_silu" or (meta["kind"] == "rms_matmul" and bool(meta["attrs"].get("silu", False)))
    return {"buffer": int(b["buffer"]), "offset": int(b["offset"]), "ldw": int(b["strides"][1]),
            "K": int(a["shape"][1]), "N": int(tables.buffers[int(o["output"])]["shape"][1]), "glu": glu}


def task_slots(spec: dict, lo: int, hi: int) -> np.ndarray:
    """The slots of one task over output columns [lo, hi), in linear_ring's order: passes of 64
    columns (gate·up: 32), in each the groups of 256 k, in each the pass's 32-row blocks (gate·up:
    the gate rows, then the matching up rows N further)."""
    K, ldw, glu = spec["K"], spec["ldw"], spec["glu"]
    groups = -(-K // RING_K)
    k0 = np.arange(groups, dtype=np.int64) * RING_K
    words = (np.minimum(RING_K, K - k0) * 2 // 16).astype(np.uint8)
    width = RING_ROWS if glu else 2 * RING_ROWS
    parts = []
    for n0 in range(lo, hi, width):
        cols = min(width, hi - n0)
        if glu:
            blocks = [(n0, cols), (spec["N"] + n0, cols)]
        else:
            blocks = [(n0, min(RING_ROWS, cols))] + ([(n0 + RING_ROWS, cols - RING_ROWS)] if cols > RING_ROWS else [])
        d = np.zeros((groups, len(blocks)), DESC_DTYPE)
        for j, (row0, rows) in enumerate(blocks):
            d["offset"][:, j] = (spec["offset"] + row0 * ldw + k0) * 2
            d["rows"][:, j] = rows
        d["words"] = words[:, None]
        parts.append(d.reshape(-1))
    out = np.concatenate(parts) if parts else np.zeros(0, DESC_DTYPE)
    out["stride"] = ldw * 2
    out["buffer"] = spec["buffer"]
    return out


def _tile_columns(tables: Tables, op: int, tile: int) -> tuple[int, int]:
    """Output columns [lo, hi) of a 2-d op's tile (tiles in C order, balanced splits)."""
    o = tables.ops[op]
    g = int(o["grid"][1])
    n = int(tables.buffers[int(o["output"])]["shape"][1])
    i = tile % g
    return i * n // g, (i + 1) * n // g


def worker_streams(tables: Tables, per_worker: list[np.ndarray], ring_ops: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every worker's stream (its AOT tasks of ``ring_ops`` in list order), each followed by its
    first DESC_BLOCK descriptors again (so a block read at any position stays in bounds), and the
    CSR offsets [w, w + 1) into them. A worker without ring tasks has an empty range."""
    specs = {op: _linear_spec(tables, op) for op in ring_ops}
    cache: dict[tuple[int, int], np.ndarray] = {}
    streams, offsets = [], [0]
    ops, tiles = tables.tasks["op"], tables.tasks["tile"]
    for order in per_worker:
        parts = []
        for task in order:
            op = int(ops[task])
            if op not in specs:
                continue
            key = (op, int(tiles[task]))
            if key not in cache:
                cache[key] = task_slots(specs[op], *_tile_columns(tables, op, key[1]))
            parts.append(cache[key])
        s = np.concatenate(parts) if parts else np.zeros(0, DESC_DTYPE)
        if len(s):
            s = np.concatenate([s, s[np.arange(DESC_BLOCK) % len(s)]])
        streams.append(s)
        offsets.append(offsets[-1] + len(s))
    table = np.concatenate(streams) if offsets[-1] else np.zeros(DESC_BLOCK, DESC_DTYPE)
    return table, np.asarray(offsets, np.int32)


def ring_bytes(slots: int) -> int:
    """Dynamic shared memory of a ring of ``slots`` slots: the slots, two descriptor halves, and
    the full and empty barriers per slot and the two descriptor barriers."""
    return slots * RING_SLOT_BYTES + 2 * DESC_BLOCK * DESC_DTYPE.itemsize + 8 * (2 * slots + 2)


def ring_slots_that_fit(free_bytes: int) -> int:
    """The most slots (≤ MAX_SLOTS) whose ring fits ``free_bytes``; 0 below MIN_SLOTS."""
    n = MAX_SLOTS
    while n >= MIN_SLOTS and ring_bytes(n) > free_bytes:
        n -= 1
    return n if n >= MIN_SLOTS else 0
