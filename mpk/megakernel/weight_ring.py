"""The weight rings' streams: what each worker's ring (``cuda/mpk_tasks/weight_ring.cuh``) copies,
slot by slot, in the order its linear tasks (``linear_ring`` in ``linalg.cuh``) read it.

A worker's AOT list is fixed before the launch, and the weights of its variant-1 linear tasks
are graph inputs that nothing in the kernel writes, so the host can lay out the worker's whole
weight stream ahead: one 16-byte descriptor per slot (up to 32 weight rows × 256 k). A slot is
filled by up to four TMA tensor copies, boxes of 64 k × 8, 16, 24 or 32 rows (the block's rows
rounded up to 8; four tensor maps per weight, one per height; reads past the weight's extent
fill zeros). (One bulk copy per 512-byte row piece measured 3× slower than no ring at all on
an H200: the copy engine's cost is per request.) The device consumer walks the same order —
this module and ``linear_ring`` must agree, and ``tests/test_weight_ring.py`` replays it.
"""

from __future__ import annotations

import numpy as np

from mpk.compiler.tables import Tables

RING_ROWS = 32  # kRingRows: weight rows per slot
RING_K = 256  # kRingK: k elements of a row per slot
BOX_K = 64  # kRingBoxK: k elements per tensor copy (128 bytes: the 128-byte swizzle's row)
BOX_HEIGHTS = (8, 16, 24, 32)  # a weight's tensor maps, by box height
RING_SLOT_BYTES = RING_ROWS * RING_K * 2  # kRingSlotBytes
RING_ALIGN = 1024  # the 128-byte swizzle's atom: slots start at multiples of it
DESC_BLOCK = 16  # kRingDescBlock: descriptors per bulk copy; each stream's first block is repeated after it
MIN_SLOTS = 4  # a group of 2 slots must land while the 2 before it are read (linear_ring's refill lag)
MAX_SLOTS = 12

# mpk::RingDesc: the tensor map, the box's k0 (x) and first row (y), copies (64-k boxes) and box height
DESC_DTYPE = np.dtype([("map", "<u4"), ("x", "<i4"), ("y", "<i4"), ("boxes", "u1"), ("box_rows", "u1"),
                       ("pad", "u1", (2,))])
assert DESC_DTYPE.itemsize == 16


def _linear_spec(tables: Tables, op: int) -> dict:
    """What the stream needs of a variant-1 linear op: the weight (buffer, its view's offset and
    row stride in elements, K, its rows: N or 2N), the output width N and whether it is a gate·up
    (SiLU·mul) op."""
    o = tables.ops[op]
    meta = tables.meta["ops"][op]
    a, b = (tables.views[int(x)] for x in tables.op_inputs[[o["first_input"], o["first_input"] + 1]])
    glu = meta["kind"] == "matmul_silu" or (meta["kind"] == "rms_matmul" and bool(meta["attrs"].get("silu", False)))
    return {"weight": (int(b["buffer"]), int(b["offset"]), int(b["strides"][1]), int(a["shape"][1]),
                       int(b["shape"][1])),
            "K": int(a["shape"][1]), "N": int(tables.buffers[int(o["output"])]["shape"][1]), "glu": glu}


def task_slots(spec: dict, lo: int, hi: int, weight_index: int = 0) -> np.ndarray:
    """The slots of one task over output columns [lo, hi), in linear_ring's order: passes of 64
    columns (gate·up: 32), in each the groups of 256 k, in each the pass's 32-row blocks (gate·up:
    the gate rows, then the matching up rows N further). ``weight_index``: the weight's place in
    the tensor-map table (four maps each)."""
    K, glu = spec["K"], spec["glu"]
    groups = -(-K // RING_K)
    k0 = np.arange(groups, dtype=np.int64) * RING_K
    boxes = (-(-np.minimum(RING_K, K - k0) // BOX_K)).astype(np.uint8)
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
            height = -(-rows // 8) * 8
            d["map"][:, j] = len(BOX_HEIGHTS) * weight_index + BOX_HEIGHTS.index(height)
            d["y"][:, j] = row0
            d["box_rows"][:, j] = height
        d["x"] = k0[:, None]
        d["boxes"] = boxes[:, None]
        parts.append(d.reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, DESC_DTYPE)


def _tile_columns(tables: Tables, op: int, tile: int) -> tuple[int, int]:
    """Output columns [lo, hi) of a 2-d op's tile (tiles in C order, balanced splits)."""
    o = tables.ops[op]
    g = int(o["grid"][1])
    n = int(tables.buffers[int(o["output"])]["shape"][1])
    i = tile % g
    return i * n // g, (i + 1) * n // g


def worker_streams(tables: Tables, per_worker: list[np.ndarray],
                   ring_ops: set[int]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int, int]]]:
    """Every worker's stream (its AOT tasks of ``ring_ops`` in list order), each followed by its
    first DESC_BLOCK descriptors again (so a block read at any position stays in bounds); the
    CSR offsets [w, w + 1) into them (a worker without ring tasks has an empty range); and the
    weights the descriptors' tensor maps index (buffer, offset, row stride, K, rows), in order."""
    specs = {op: _linear_spec(tables, op) for op in sorted(ring_ops)}
    weights = sorted({spec["weight"] for spec in specs.values()})
    index = {w: i for i, w in enumerate(weights)}
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
                cache[key] = task_slots(specs[op], *_tile_columns(tables, op, key[1]), index[specs[op]["weight"]])
            parts.append(cache[key])
        s = np.concatenate(parts) if parts else np.zeros(0, DESC_DTYPE)
        if len(s):
            s = np.concatenate([s, s[np.arange(DESC_BLOCK) % len(s)]])
        streams.append(s)
        offsets.append(offsets[-1] + len(s))
    table = np.concatenate(streams) if offsets[-1] else np.zeros(DESC_BLOCK, DESC_DTYPE)
    return table, np.asarray(offsets, np.int32), weights


def tensor_maps(weights: list[tuple[int, int, int, int, int]], pointers: list[int]) -> bytes:
    """The descriptors' tensor maps: per weight, one per box height, over the weight's rows
    (16-bit elements, K of each row, rows ``row stride`` apart) at its buffer's address."""
    from mpk.megakernel import cuda_driver as drv

    out = []
    for buffer, offset, ldw, K, rows in weights:
        for height in BOX_HEIGHTS:
            out.append(drv.encode_tensor_map_2d(pointers[buffer] + 2 * offset, K, rows, 2 * ldw, BOX_K, height))
    return b"".join(out)


def ring_bytes(slots: int) -> int:
    """Dynamic shared memory of a ring of ``slots`` slots: room to align it to RING_ALIGN, the
    slots, two descriptor halves, the full and empty barriers per slot and the two descriptor
    barriers."""
    return RING_ALIGN + slots * RING_SLOT_BYTES + 2 * DESC_BLOCK * DESC_DTYPE.itemsize + 8 * (2 * slots + 2)


def ring_slots_that_fit(free_bytes: int) -> int:
    """The most slots (≤ MAX_SLOTS) whose ring fits ``free_bytes``; 0 below MIN_SLOTS."""
    n = MAX_SLOTS
    while n >= MIN_SLOTS and ring_bytes(n) > free_bytes:
        n -= 1
    return n if n >= MIN_SLOTS else 0
