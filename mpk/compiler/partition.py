"""Step 1 — decompose: every op becomes a grid of tasks, one per output tile.

Default tile counts aim at one wave over the workers (``num_workers`` tasks per op) and follow
the op kind's split order (a matmul splits N first so each weight column is streamed once),
never making tiles smaller than the kind's ``min_tile_elems``; a kind may pick its grid itself
(``default_grid``: a matmul on the tensor cores splits both dims into whole MMA tiles). A user
override gives the tile count per output dim, by op name or by op kind.

One exception, for placement: an op right after a *narrow* op of long tasks whose output it
reads (a kind with ``long_tasks``, num_workers/4 to num_workers/2 tasks: decode attention of 8
kv heads at batch 4–8) aims at the workers that op leaves free. AOT tasks are placed round-robin
in linear order (step 7a, mpk/compiler/place.py; an op dealt by ``tile_cost`` takes the same
workers when it has no more tasks than workers), so its tasks then land on none of the narrow
op's workers, which come back from their long tasks last and would open its stage late. Fewer
tiles make every task longer, so this holds only while a task's extra input stays within
``NARROW_EXTRA_BYTES`` (80 KiB, a small share of a task's time at a worker's share of HBM
bandwidth). With fewer than num_workers/4 narrow tasks the gain is small and the nearly full tile
count splits columns unevenly (its longer tiles then start the next stage late), hence the
lower bound.
"""

from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from mpk.compiler.taskgraph import OpTiles, TaskGraph
from mpk.errors import CompileError
from mpk.ir.opgraph import Op, OpGraph
from mpk.ops import OpSig, get_op
from mpk.ops.registry import REGISTRY, min_tile_elems

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
    if not isinstance(spec, (Mapping, list, tuple)):
        raise CompileError(f"partition for op {op.name!r} ({op.kind}) is {spec!r}; expected a list of one tile "
                           f"count per dim of its output {sig.out_shape}, or a dict dim -> count")
    items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
    if not isinstance(spec, Mapping) and len(spec) != ndim:
        raise CompileError(f"partition for op {op.name!r} ({op.kind}) has {len(spec)} entries; its output "
                           f"{sig.out_shape} has {ndim} dims (give one tile count per dim, or a dict dim -> count)")
    splittable = get_op(op.kind).splittable(sig)
    seen: dict[int, object] = {}
    for d, n in items:
        given = d
        if isinstance(d, str) and d.lstrip("-").isdigit():  # JSON object keys are strings
            d = int(d)
        if not isinstance(d, int) or isinstance(d, bool) or not -ndim <= d < ndim:
            raise CompileError(f"partition for op {op.name!r}: dim {d!r} out of range for output {sig.out_shape}")
        d %= ndim
        if d in seen:  # {0: 2, -2: 3} for a 2-d output: which count was meant is unclear
            raise CompileError(f"partition for op {op.name!r}: dims {seen[d]!r} and {given!r} are both dim {d} of "
                               f"output {sig.out_shape}; expected each dim once")
        seen[d] = given
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= sig.out_shape[d]:
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
    # an op kind may be absent from this graph and present in another of the same model (a graph
    # break, the eager fallback's pieces); an op name must be this graph's
    names = {op.name for op in graph.ops} | REGISTRY.keys()
    unknown = sorted(k for k in overrides if k not in names)
    if unknown:
        raise CompileError(f"partition overrides name {unknown}, which match no op name or kind; "
                           f"ops: {[op.name for op in graph.ops][:20]} (names are per compiled graph), "
                           f"kinds: {sorted(REGISTRY)}")
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
            free = num_workers - _narrow_producer_tasks(graph, op, sig, tiles, num_workers)
            grid = _default_grid(opdef, sig, free)
        op.partition = grid
        bounds = tuple(split_bounds(n, g) for n, g in zip(sig.out_shape, grid))
        t = OpTiles(op.id, sig, grid, bounds, len(task_op))
        tiles.append(t)
        task_op += [op.id] * t.num_tasks
        task_tile += range(t.num_tasks)
    return TaskGraph(graph, tiles, task_op, task_tile)


NARROW_EXTRA_BYTES = 80 << 10  # see the module doc


def _narrow_producer_tasks(graph: OpGraph, op: Op, sig: OpSig, tiles: list[OpTiles], num_workers: int) -> int:
    """Tasks of the op just before ``op`` if that op is narrow, of a ``long_tasks`` kind, and
    ``op`` reads its output (see the module doc), else 0."""
    if not tiles:
        return 0
    prev = graph.ops[tiles[-1].op_id]
    if not get_op(prev.kind).long_tasks:
        return 0
    n = tiles[-1].num_tasks
    if not (num_workers // 4 <= n <= num_workers // 2 and any(v.buffer == prev.output for v in op.inputs)):
        return 0
    in_bytes = sum(prod(s) for s in sig.in_shapes) * graph.buffers[op.output].dtype.itemsize
    extra = in_bytes / (num_workers - n) - in_bytes / num_workers  # per task, against num_workers tiles
    return n if extra <= NARROW_EXTRA_BYTES else 0


def _default_grid(opdef, sig: OpSig, num_workers: int) -> tuple[int, ...]:
    own = opdef.default_grid(sig, num_workers) if opdef.default_grid is not None else None
    if own is not None:
        return own
    splittable = opdef.splittable(sig)
    grid = [1] * len(sig.out_shape)
    budget = max(1, min(num_workers, prod(sig.out_shape) // max(1, min_tile_elems(opdef, sig))))
    for d in opdef.split_order(sig):
        room = budget // prod(grid)
        if room <= 1:
            break
        if splittable[d]:
            grid[d] = min(sig.out_shape[d], room)
    return tuple(grid)
