"""Step 2 — depend: exact producer→consumer edges between tasks.

Edge (t1, t2) iff the tile t1 writes intersects a region t2 reads. Each read is mapped through
its view to exact rects of the buffer; the producer's tiles form a grid, so the overlapping
tiles are found per dimension by binary search over the grid boundaries (a sorted index) and
combined — no all-pairs comparison, cost proportional to the edges found.

``whole_ops`` (the ``pipelining=False`` ablation) then widens every edge to the producer's whole
op: a task waits for all tasks of each op it reads from, as op-by-op kernels would, so no task
overlaps the op before it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import product

from mpk.compiler.taskgraph import OpTiles, TaskGraph
from mpk.ir.regions import Rect
from mpk.ir.views import View
from mpk.ops import get_op


def _overlapping(prod_tiles: OpTiles, rect: Rect) -> list[int]:
    """Task ids of the producer tiles that intersect ``rect`` (a rect of the producer's output)."""
    ranges = []
    for (a, b), bounds in zip(rect, prod_tiles.bounds):
        lo = bisect_right(bounds, a) - 1
        hi = bisect_left(bounds, b)
        ranges.append(range(lo, hi))
    grid = prod_tiles.grid
    strides = [1] * len(grid)
    for d in range(len(grid) - 2, -1, -1):
        strides[d] = strides[d + 1] * grid[d + 1]
    base = prod_tiles.first_task
    return [base + sum(i * s for i, s in zip(idx, strides)) for idx in product(*ranges)]


def depend(tg: TaskGraph) -> TaskGraph:
    producer = {tg.graph.ops[t.op_id].output: t for t in tg.tiles}
    cache: dict[tuple[View, Rect], tuple[int, ...]] = {}
    preds: list[tuple[int, ...]] = []
    edges = 0
    for tiles in tg.tiles:
        op = tg.graph.ops[tiles.op_id]
        regions_of = get_op(op.kind).input_regions
        for tile in range(tiles.num_tasks):
            found: set[int] = set()
            for view, rect in zip(op.inputs, regions_of(tiles.sig, tiles.tile_rect(tile))):
                src = producer.get(view.buffer)
                if rect is None or src is None:
                    continue
                key = (view, rect)
                hit = cache.get(key)
                if hit is None:
                    ids: set[int] = set()
                    for base_rect in view.base_regions(rect):
                        ids.update(_overlapping(src, base_rect))
                    hit = cache[key] = tuple(ids)
                found.update(hit)
            p = tuple(sorted(found))
            preds.append(p)
            edges += len(p)
    tg.preds, tg.num_edges = preds, edges
    return tg


def whole_ops(tg: TaskGraph) -> TaskGraph:
    """Widen each task's predecessors to every task of the ops they belong to (module doc): the
    baseline without cross-task pipelining. A superset of the exact edges, so still safe."""
    tasks_of = {t.op_id: tuple(range(t.first_task, t.first_task + t.num_tasks)) for t in tg.tiles}
    widened: dict[tuple[int, ...], tuple[int, ...]] = {}
    for i, preds in enumerate(tg.preds):
        if preds not in widened:
            ops = sorted({tg.task_op[p] for p in preds})
            widened[preds] = tuple(t for op in ops for t in tasks_of[op])
        tg.preds[i] = widened[preds]
    tg.num_edges = sum(len(p) for p in tg.preds)
    return tg
