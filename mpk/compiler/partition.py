"""Step 1 — decompose: every op becomes a grid of tasks, one per output tile.

Default tile counts aim at one wave over the workers (``num_workers`` tasks per op) and follow
the op kind's split order (a matmul splits N first so each weight column is streamed once),
never making tiles smaller than the kind's ``min_tile_elems``. A user override gives the tile
count per output dim, by op name or by op kind.
"""

from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from mpk.compiler.taskgraph import OpTiles, TaskGraph
from mpk.errors import CompileError
from mpk.ir.opgraph import Op, OpGraph
from mpk.ops import OpSig, get_op

PartitionSpec = Sequence[int] | Mapping[int, int]


def op_sig(graph: OpGraph, op: Op) -> OpSig:
    out = graph.buffers[op.output]
    return OpSig(tuple(v.shape for v in op.inputs), out.shape, out.dtype, op.attrs)


def split_bounds(extent: int, parts: int) -> tuple[int, ...]:
    """Balanced boundaries: tile sizes differ by at most one."""
    return tuple((i * extent) // parts for i in range(parts + 1))


def _override_grid(op: Op, sig: OpSig, spec: PartitionSpec) -> tuple[int, ...]:
    ndim = len(sig.out_shape)
    grid = [1] * ndim
    items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
    if not isinstance(spec, Mapping) and len(spec) != ndim:
        raise CompileError(f"partition for op {op.name!r} ({op.kind}) has {len(spec)} entries; its output "
                           f"{sig.out_shape} has {ndim} dims (give one tile count per dim, or a dict dim -> count)")
    splittable = get_op(op.kind).splittable(sig)
    for d, n in items:
        if isinstance(d, str) and d.lstrip("-").isdigit():  # JSON object keys are strings
            d = int(d)
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise CompileError(f"partition for op {op.name!r}: dim {d} out of range for output {sig.out_shape}")
        d %= ndim
        if not isinstance(n, int) or not 1 <= n <= sig.out_shape[d]:
            raise CompileError(f"partition for op {op.name!r}: {n!r} tiles for dim {d} of size "
                               f"{sig.out_shape[d]}; expected an int in [1, {sig.out_shape[d]}]")
        if n > 1 and not splittable[d]:
            raise CompileError(f"partition for op {op.name!r} ({op.kind}): dim {d} cannot be split "
                               f"(each tile needs it whole); splittable dims: "
                               f"{[i for i, s in enumerate(splittable) if s]}")
        grid[d] = n
    return tuple(grid)


def decompose(graph: OpGraph, num_workers: int,
              overrides: Mapping[str, PartitionSpec] | None = None) -> TaskGraph:
    overrides = dict(overrides or {})
    names = {op.name for op in graph.ops} | {op.kind for op in graph.ops}
    unknown = sorted(k for k in overrides if k not in names)
    if unknown:
        raise CompileError(f"partition overrides name {unknown}, which match no op name or kind; "
                           f"ops: {[op.name for op in graph.ops][:20]}")
    tiles: list[OpTiles] = []
    task_op: list[int] = []
    task_tile: list[int] = []
    for op in graph.ops:
        sig = op_sig(graph, op)
        opdef = get_op(op.kind)
        spec = overrides.get(op.name, overrides.get(op.kind))
        if spec is not None:
            grid = _override_grid(op, sig, spec)
        else:
            grid = _default_grid(opdef, sig, num_workers)
        op.partition = grid
        bounds = tuple(split_bounds(n, g) for n, g in zip(sig.out_shape, grid))
        t = OpTiles(op.id, sig, grid, bounds, len(task_op))
        tiles.append(t)
        task_op += [op.id] * t.num_tasks
        task_tile += range(t.num_tasks)
    return TaskGraph(graph, tiles, task_op, task_tile)


def _default_grid(opdef, sig: OpSig, num_workers: int) -> tuple[int, ...]:
    splittable = opdef.splittable(sig)
    grid = [1] * len(sig.out_shape)
    budget = max(1, min(num_workers, prod(sig.out_shape) // max(1, opdef.min_tile_elems)))
    for d in opdef.split_order(sig):
        room = budget // prod(grid)
        if room <= 1:
            break
        if splittable[d]:
            grid[d] = min(sig.out_shape[d], room)
    return tuple(grid)
