"""Collectives between the ranks of a tensor-parallel graph: ``comm_put``, ``all_reduce`` and
``all_gather`` (cuda/mpk_tasks/comm.cuh runs them; mpk.distributed.shard inserts them).

**Two task kinds per collective.** The sharding pass emits a collective as two ops of the
registry, so each task kind is an ordinary op the compiler tiles, orders and places:

* ``comm_put`` (tile t of its grid): once the producer's tile t is written, copy it into every
  peer's symmetric receive buffer, slot ``[parity, my rank]``, then release-store the tile's
  sequence number into that peer's signal ``[my rank, t]``. Its output is one int64 per tile
  (the sequence number sent), which only orders the reduce after it;
* ``all_reduce`` / ``all_gather`` (tile t): wait until every peer's signal for tile t reaches
  the sequence number this tile expects, then combine: the reduce sums the ranks' tiles in
  float32 **in rank order 0…world−1** (its own from its local input, bit-identical to what the
  peers received) plus an optional residual, so every rank computes the same bits; the gather
  copies rank r's tile to ``out[:, r, :]`` (output [M, world, N]).

The put and the reduce of tile t read tile t of the producer, so each waits on exactly the
matmul tiles it needs (the compiler's ordinary events), and the first tiles' transfers run while
later tiles still compute. Both kinds take their grid from ``attrs["tiles"]`` (the signal
index), which a partition override must not change.

**Sequence numbers, not iterations.** ``seq`` [1 + world, T] int64 is a rank-local graph
input written in place: ``seq[0, t]`` counts tile t's puts, ``seq[1 + r, t]`` the tiles t from
rank r consumed. The n-th put of a tile and the n-th reduce of it are both in the n-th
iteration since the buffers were made (iterations of one launch and launches alike), so the
receiver expects ``signal[r, t] ≥ seq[1 + r, t] + 1``. Signals only grow (monotonic, one
writer each), like the runtime's event counters, and nothing is reset between launches.

**Parity double-buffering.** Sequence n uses slot ``n % 2``. Why a fast rank never overwrites
a slot a slow rank has not consumed: rank r's put of sequence n + 2 into peer p's slot runs in
r's iteration n + 2, after r's iteration n + 1 ended (the end event of an iteration starts the
next), so after r's reduce n + 1 of that tile, which waited for p's put n + 1 of it, which ran
in p's iteration n + 1, after p's iteration n ended, so after p consumed sequence n of the
tile. The receiver reads only after the signal (acquire), so it never reads early either.

**No cross-rank deadlock.** Every rank runs the same tables; the reduce of tile t reads the
put's token t, so in the linear task order (shared by all ranks, each worker's queue following
it) the put precedes its reduce. By induction over that order every task completes: its events
and its queue predecessors are earlier tasks, and a reduce's signals come from peers' puts,
earlier tasks too. This holds for AOT tasks (a DecoderLM step's collectives are); a JIT
reduce waiting inside its task would hold its worker's ring, which the argument does not cover.
"""

from __future__ import annotations

import torch

from mpk.errors import CompileError
from mpk.ir.regions import Rect
from mpk.ops.gpu import CTYPES, GpuSpec, OpInfo, Params
from mpk.ops.registry import OpDef, OpSig, register

COLLECTIVES = ("all_reduce", "all_gather")
MAX_RANKS = 64  # cuda/mpk_tasks/comm.cuh: kMaxRanks


def slot_of(seq: int) -> int:
    """The receive slot (0 or 1) of a tile's sequence number ``seq``: parity double-buffering."""
    return seq % 2


def tile_bounds(extent: int, parts: int, i: int) -> tuple[int, int]:
    """Tile i of the balanced split of ``extent`` into ``parts`` (the compiler's split)."""
    return i * extent // parts, (i + 1) * extent // parts


def tile_index(extent: int, parts: int, start: int) -> int:
    """The tile of the balanced split whose first element is ``start`` (CUDA: the same formula)."""
    return -(-start * parts // extent)


def _tile(sig: OpSig, rows: Rect, m: int, n: int) -> tuple[int, int, Rect]:
    """(tile number, signal column index, the tile's rect of the [M, N] data) for a rect of a
    collective's grid; CompileError unless the rect is one whole tile of attrs['tiles']."""
    tm, tn = sig.attrs["tiles"]
    (r0, r1), (c0, c1) = rows
    i, j = tile_index(m, tm, r0), tile_index(n, tn, c0)
    if (r0, r1) != tile_bounds(m, tm, i) or (c0, c1) != tile_bounds(n, tn, j):
        raise CompileError(f"collective tile {rows} is not one tile of its fixed grid {tm} x {tn} over [{m}, {n}]; "
                           "do not override a collective's partition (its tiles are its signal indices)")
    return i * tn + j, j, ((r0, r1), (c0, c1))


def _heap():
    from mpk.distributed import symmetric  # the CPU simulation of peer memory (imports mpk.ops)

    return symmetric


# --- comm_put ------------------------------------------------------------------------------------
# inputs: src [M, N], peers of recv [world] int64, peers of signals [world] int64, seq [1 + world, T]

def _put_grid_rect(sig: OpSig, rect: Rect) -> Rect:
    """A put tile (one element of its [tm, tn] token output) → its rect of src."""
    tm, tn = sig.attrs["tiles"]
    m, n = sig.in_shapes[0]
    (i, _), (j, _) = rect
    if rect[0][1] - i != 1 or rect[1][1] - j != 1:
        raise CompileError(f"comm_put tile {rect} spans several signal tiles of its grid {tm} x {tn}; "
                           "do not override a collective's partition")
    return tile_bounds(m, tm, i), tile_bounds(n, tn, j)


def _put_regions(sig: OpSig, rect: Rect):
    t = rect[0][0] * sig.attrs["tiles"][1] + rect[1][0]
    world = sig.attrs["world"]
    return [_put_grid_rect(sig, rect), ((0, world),), ((0, world),), ((0, 1), (t, t + 1))]


def _put_writes(sig: OpSig, rect: Rect):
    t = rect[0][0] * sig.attrs["tiles"][1] + rect[1][0]
    return [(3, ((0, 1), (t, t + 1)))]


def _put_cpu(sig: OpSig, rect: Rect, xs):
    src, peers_recv, peers_sig, seq = xs
    rank, world = sig.attrs["rank"], sig.attrs["world"]
    t = rect[0][0] * sig.attrs["tiles"][1] + rect[1][0]
    n = int(seq[0, 0]) + 1
    seq[0, 0] = n
    rows, cols = _put_grid_rect(sig, rect)
    for p in range(world):
        if p != rank:
            heap = _heap()
            heap.put(int(peers_recv[p]), (slot_of(n), rank, slice(*rows), slice(*cols)), src, n)
            heap.signal(int(peers_sig[p]), (rank, t), n)
    return torch.full((1, 1), n, dtype=sig.out_dtype)


# --- all_reduce / all_gather ---------------------------------------------------------------------
# inputs: local [M, N], token [tm, tn] (the put's output), recv [2, world, M, N],
#         signals [world, T], seq [1 + world, T] (+ all_reduce: residual [M, N], optional)

def _data_rect(sig: OpSig, rect: Rect) -> tuple[int, Rect, Rect]:
    """(tile number, the tile's rect of the [M, N] data, its element of the token grid)."""
    m, n = sig.in_shapes[0]
    data = rect if len(rect) == 2 else (rect[0], rect[2])  # a gather tile: (rows, rank, cols)
    t, _, r = _tile(sig, data, m, n)
    tn = sig.attrs["tiles"][1]
    return t, r, ((t // tn, t // tn + 1), (t % tn, t % tn + 1))


def _ranks_of(sig: OpSig, rect: Rect) -> range:
    """The ranks whose data a tile combines: all of them (reduce), or its rank dim (gather)."""
    return range(sig.attrs["world"]) if len(rect) == 2 else range(*rect[1])


def _combine_regions(sig: OpSig, rect: Rect):
    t, data, token = _data_rect(sig, rect)
    world = sig.attrs["world"]
    ranks = _ranks_of(sig, rect)
    seq = ((1 + ranks.start, 1 + ranks.stop), (t, t + 1))
    regions = [data, token, ((0, 2), (0, world)) + data, ((0, world), (t, t + 1)), seq]
    return regions + [data] * (len(sig.in_shapes) - 5)


def _combine_writes(sig: OpSig, rect: Rect):
    return [(4, _combine_regions(sig, rect)[4])]


def _combine_wait(sig: OpSig, rect: Rect, xs) -> str | None:
    """None once every peer's signal for the tile reached the sequence number expected, else
    what the tile waits for (the interpreter's deadlock report names it)."""
    _, _, _, signals, seq = xs[:5]
    t = _data_rect(sig, rect)[0]
    ranks = _ranks_of(sig, rect)
    for k, r in enumerate(ranks):
        need = int(seq[k, 0]) + 1
        if r != sig.attrs["rank"] and int(signals[r, 0]) < need:
            return f"signal [rank {r}, tile {t}] = {int(signals[r, 0])}, needs ≥ {need}"
    return None


def _combine_cpu(sig: OpSig, rect: Rect, xs):
    local, _, recv, _, seq, *residual = xs
    rank = sig.attrs["rank"]
    ranks = _ranks_of(sig, rect)
    parts = []
    for k, r in enumerate(ranks):
        n = int(seq[k, 0]) + 1
        seq[k, 0] = n
        if r == rank:
            parts.append(local)
        else:
            _heap().consume(recv[slot_of(n), r], n, r, rank)
            parts.append(recv[slot_of(n), r])
    if len(rect) == 3:  # gather: the tile's one rank
        return parts[0].to(sig.out_dtype).unsqueeze(1)
    acc = torch.zeros(local.shape, dtype=torch.float32)
    for p in parts:  # rank order, float32: every rank gets the same bits
        acc = acc + p.to(torch.float32)
    if residual:
        acc = residual[0].to(torch.float32) + acc
    return acc.to(sig.out_dtype)


def _reduce_grid(sig: OpSig, workers: int) -> tuple[int, ...]:
    return tuple(sig.attrs["tiles"])


def _gather_grid(sig: OpSig, workers: int) -> tuple[int, ...]:
    tm, tn = sig.attrs["tiles"]
    return tm, sig.attrs["world"], tn


# --- GPU ------------------------------------------------------------------------------------------

def _params(op: OpInfo) -> Params:
    """iparam: rank, world, tiles (rows, cols), data rows M and columns N."""
    tm, tn = op.attrs["tiles"]
    m, n = op.inputs[0].shape
    return [op.attrs["rank"], op.attrs["world"], tm, tn, m, n], []


def _check(op: OpInfo) -> None:
    if op.attrs["world"] > MAX_RANKS:
        raise op.error(f"world {op.attrs['world']}; the CUDA collectives take at most {MAX_RANKS} ranks")
    for v in op.inputs[:1] + op.inputs[5:]:
        if v.strides[-1] != 1 and v.shape[-1] > 1:
            raise op.error(f"the collective's data must be contiguous along its last dim; strides {list(v.strides)}")
    if op.kind != "comm_put" and op.inputs[2].dtype != op.inputs[0].dtype:
        raise op.error(f"the receive buffer is {op.inputs[2].dtype}, its data {op.inputs[0].dtype}; expected one dtype")


def _typed(name: str):
    def task(op: OpInfo) -> str:
        if op.inputs[0].dtype not in CTYPES:
            raise op.error(f"{op.kind} takes {sorted(str(d) for d in CTYPES)} data; got {op.inputs[0].dtype}")
        return f"mpk::{name}<{CTYPES[op.inputs[0].dtype]}>"
    return task


register(OpDef(
    kind="comm_put", type_id=50, input_regions=_put_regions, cpu=_put_cpu,
    default_grid=lambda sig, workers: tuple(sig.attrs["tiles"]), inplace_writes=_put_writes,
    gpu=GpuSpec(params=_params, task=_typed("comm_put"), check=_check),
    doc="put tile t of src into every peer's receive slot [seq % 2, rank], then signal it",
))
register(OpDef(
    kind="all_reduce", type_id=51, input_regions=_combine_regions, cpu=_combine_cpu, wait=_combine_wait,
    default_grid=_reduce_grid, inplace_writes=_combine_writes,
    gpu=GpuSpec(params=_params, task=_typed("comm_reduce"), check=_check),
    doc="out = residual + Σ_r (rank r's tile), float32, in rank order",
))
register(OpDef(
    kind="all_gather", type_id=52, input_regions=_combine_regions, cpu=_combine_cpu, wait=_combine_wait,
    default_grid=_gather_grid, inplace_writes=_combine_writes,
    gpu=GpuSpec(params=_params, task=_typed("comm_gather"), check=_check),
    doc="out[:, r, :] = rank r's [M, N]",
))
