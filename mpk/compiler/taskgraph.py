"""The compiler's task-graph IR (what steps 1–7a build up before step 7 flattens it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpk.ir.opgraph import OpGraph
from mpk.ir.regions import Rect, tile_rect
from mpk.ops import OpSig

DUMMY = -1  # task_op of a dummy task (normalization): no work, only event plumbing


@dataclass
class OpTiles:
    """Step 1's result for one op: a grid of tiles over its output buffer."""

    op_id: int
    sig: OpSig
    grid: tuple[int, ...]
    bounds: tuple[tuple[int, ...], ...]  # per dim, grid[d] + 1 boundaries
    first_task: int

    @property
    def num_tasks(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    def tile_rect(self, tile: int) -> Rect:
        return tile_rect(self.grid, self.bounds, tile)


@dataclass
class Event:
    """Fires when all ``triggers`` have run; then launches ``launches``."""

    triggers: tuple[int, ...]
    launches: tuple[int, ...]


@dataclass
class TaskGraph:
    graph: OpGraph
    tiles: list[OpTiles]
    task_op: list[int]  # op id per task, DUMMY for dummy tasks
    task_tile: list[int]
    preds: list[tuple[int, ...]] = field(default_factory=list)  # step 2, per real task
    num_edges: int = 0  # after step 2b
    num_pruned_edges: int = 0  # removed by step 2b (implied by another path)
    events: list[Event] = field(default_factory=list)  # steps 3–4
    start_event: int = -1
    end_event: int = -1
    events_before_fusion: int = 0
    events_after_fusion: int = 0
    # step 5: linear order (new task id -> old task id) and event order
    task_order: list[int] = field(default_factory=list)
    event_order: list[int] = field(default_factory=list)
    jit: list[bool] = field(default_factory=list)  # step 6, per task (old ids)
    barrier: list[bool] = field(default_factory=list)  # step 6, per event (old ids)
    placement: Any = None  # step 7a: mpk.compiler.place.Placement, in linear task ids

    @property
    def num_tasks(self) -> int:
        return len(self.task_op)

