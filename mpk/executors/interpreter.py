"""The CPU reference executor: runs the tables with the runtime's event semantics.

It reads nothing but the tables (and the op registry for each kind's tile kernel), so it
checks the compiler through the same contract the GPU kernel uses:

* events are counters that are never reset; in iteration k an event fires at k·num_triggers
  arrivals and releases its task range;
* AOT tasks run on the workers the tables place them on (``worker_tasks``), in each worker's
  queue order, each once its dependent event fired: a worker whose head task waits runs none
  of its later ones, as on the GPU; JIT tasks run on any worker once released;
* among everything runnable (the ready heads of the workers' queues and the released JIT
  tasks) the next task is drawn at random (seeded), so repeated runs explore different legal
  schedules of the one placement;
* each tile is computed with PyTorch from exactly the input slices its op kind declares.

It fails loudly: ``DeadlockError`` when tasks remain and none can run, ``RaceError`` when a task
reads an element no task has written yet in this iteration or writes one already written.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mpk.compiler.tables import (FLAG_JIT, ROLE_INPUT, Tables, buffer_layouts, check_argument, op_layouts, validate,
                                 view_of)
from mpk.errors import DeadlockError, ExecutorUnavailableError, RaceError, ScheduleError
from mpk.ir.regions import Rect, tile_rect
from mpk.ops import OpDef, OpSig, op_by_type_id


@dataclass
class _Op:
    name: str
    opdef: OpDef
    sig: OpSig
    inputs: list[int]  # view ids
    output: int  # buffer id
    grid: tuple[int, ...]
    bounds: list[tuple[int, ...]]

    def tile_rect(self, tile: int) -> Rect:
        return tile_rect(self.grid, self.bounds, tile)


class Interpreter:
    """Executes ``tables`` on the CPU with their placement (``tables.num_workers`` workers).
    ``check_races`` adds per-element write tracking; ``validate_tables`` checks the structural
    invariants first (off only to study broken tables). After a run, ``schedule`` lists what
    ran in order as (iteration, task, worker), worker -1 for a JIT task."""

    def __init__(self, tables: Tables, check_races: bool = True, validate_tables: bool = True):
        if validate_tables:
            validate(tables)
        self.t, self.check_races = tables, check_races
        self.num_workers = tables.num_workers
        self.queues = tables.worker_queues()
        self.schedule: list[tuple[int, int, int]] = []
        meta = tables.meta
        self.buf_shape, self.buf_dtype = buffer_layouts(tables)
        self.views = [(int(v["buffer"]), tuple(int(s) for s in v["shape"][: v["ndim"]]),
                       tuple(int(s) for s in v["strides"][: v["ndim"]]), int(v["offset"])) for v in tables.views]
        self.ops = [_Op(m["name"], op_by_type_id(int(o["type_id"])), lay.sig, lay.inputs, lay.output, lay.grid,
                        lay.bounds) for o, m, lay in zip(tables.ops, meta["ops"], op_layouts(tables))]
        self.waits = any(op.opdef.wait is not None for op in self.ops)  # tiles that may wait on peers (OpDef.wait)
        self._index_cache: dict[int, torch.Tensor] = {}
        self.planned: dict[int, torch.Tensor] | None = None  # built at the first run, outside fake-tensor tracing

    def _plan_inplace(self) -> None:
        """Which elements of graph inputs tasks write in place (``OpDef.inplace_writes``), per
        buffer, and in key spaces for inputs addressed through run-time data (``key_spaces``):
        a read of such an element before its writer ran is a race like any other."""
        self.keys: list[dict[int, Any]] = []  # per op: input index -> KeySpace
        self.key_shape: dict[int, tuple[int, ...]] = {}  # buffer -> its key space's shape
        for op in self.ops:
            ks = {k.input: k for k in (op.opdef.key_spaces(op.sig) if op.opdef.key_spaces else [])}
            self.keys.append(ks)
            for k in ks.values():
                self.key_shape.setdefault(self.views[op.inputs[k.input]][0], tuple(k.shape))
        self.planned: dict[int, torch.Tensor] = {}  # buffer -> planned in-place writer per element (-1: none)
        for tid, rec in enumerate(self.t.tasks):
            if rec["op"] < 0:
                continue
            for b, ids in self._inplace_ids(tid):
                size = math.prod(self.key_shape.get(b, self.buf_shape[b]))
                self.planned.setdefault(b, torch.full((size,), -1, dtype=torch.int64))[ids] = tid

    def _key_ids(self, b: int, rect: Rect | None) -> torch.Tensor:
        shape = self.key_shape[b]
        if rect is None:
            return torch.arange(math.prod(shape))
        return torch.arange(math.prod(shape)).view(shape)[tuple(slice(a, c) for a, c in rect)].reshape(-1)

    def _carried_ids(self, tid: int) -> list[tuple[int, torch.Tensor]]:
        """(buffer, element ids) task ``tid`` writes for the next iteration (``OpDef.carried_writes``)."""
        op = self.ops[int(self.t.tasks[tid]["op"])]
        if op.opdef.carried_writes is None:
            return []
        return [(self.views[op.inputs[i]][0],
                 self._element_ids(op.inputs[i])[tuple(slice(a, c) for a, c in r)].reshape(-1))
                for i, r in op.opdef.carried_writes(op.sig, op.tile_rect(int(self.t.tasks[tid]["tile"])))]

    def _inplace_ids(self, tid: int) -> list[tuple[int, torch.Tensor]]:
        """(buffer, element or key ids) task ``tid`` writes in place."""
        op_id = int(self.t.tasks[tid]["op"])
        op = self.ops[op_id]
        if op.opdef.inplace_writes is None:
            return []
        out = []
        for i, r in op.opdef.inplace_writes(op.sig, op.tile_rect(int(self.t.tasks[tid]["tile"]))):
            b = self.views[op.inputs[i]][0]
            if b in self.key_shape:
                out.append((b, self._key_ids(b, r if i in self.keys[op_id] else None)))
            else:
                out.append((b, self._element_ids(op.inputs[i])[tuple(slice(a, c) for a, c in r)].reshape(-1)))
        return out

    # --- helpers ---------------------------------------------------------------------------
    def _bind(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        bufs: list[torch.Tensor | None] = [None] * len(self.buf_shape)
        n_inputs = int((self.t.buffers["role"] == ROLE_INPUT).sum())
        if len(args) != n_inputs:
            raise ValueError(f"the compiled graph takes {n_inputs} tensor arguments, got {len(args)}")
        for b, rec in enumerate(self.t.buffers):
            if rec["role"] == ROLE_INPUT:
                arg = args[int(rec["input_index"])]
                check_argument(self.t, b, arg, self.buf_shape[b], self.buf_dtype[b])
                if arg.device.type != "cpu":
                    raise ExecutorUnavailableError(f"the CPU interpreter got a tensor on {arg.device}; "
                                                   "move inputs to the CPU or use the gpu executor")
                bufs[b] = arg.detach().contiguous().view(-1)
            else:
                dtype = self.buf_dtype[b]
                fill = float("nan") if dtype.is_floating_point else -1
                bufs[b] = torch.full((math.prod(self.buf_shape[b]),), fill, dtype=dtype)
        return bufs

    def _view(self, bufs, v: int) -> torch.Tensor:
        b, shape, strides, offset = self.views[v]
        return view_of(bufs[b], shape, strides, offset)

    def _element_ids(self, v: int) -> torch.Tensor:
        """Flat buffer index of every element of view ``v`` (for the race detector)."""
        if v not in self._index_cache:
            b, shape, strides, offset = self.views[v]
            self._index_cache[v] = torch.arange(math.prod(self.buf_shape[b])).as_strided(shape, strides, offset)
        return self._index_cache[v]

    def _describe_task(self, tid: int) -> str:
        rec = self.t.tasks[tid]
        if rec["op"] < 0:
            return f"task {tid} (dummy)"
        op = self.ops[int(rec["op"])]
        return f"task {tid} (op {op.name!r} tile {op.tile_rect(int(rec['tile']))})"

    def _owner(self, buffer: int, flat: int) -> str:
        """Which task is meant to write element ``flat`` of ``buffer``, from the tables."""
        coord, rest = [], flat
        for s in reversed(self.buf_shape[buffer]):
            rest, i = divmod(rest, s)
            coord.append(i)
        coord = tuple(reversed(coord))
        if buffer in self.planned and int(self.planned[buffer][flat]) >= 0:
            return f"element {coord}, written in place by {self._describe_task(int(self.planned[buffer][flat]))}"
        for tid, rec in enumerate(self.t.tasks):
            if rec["op"] >= 0 and self.ops[int(rec["op"])].output == buffer:
                rect = self.ops[int(rec["op"])].tile_rect(int(rec["tile"]))
                if all(a <= c < b for c, (a, b) in zip(coord, rect)):
                    return f"element {coord}, written by {self._describe_task(tid)}"
        return f"element {coord}, which no task writes"

    # --- execution ---------------------------------------------------------------------------
    def _run_task(self, tid: int, bufs, writer, iteration: int, carried: dict[int, torch.Tensor] | None = None) -> None:
        """Run task ``tid``; with ``writer`` (race tracking), ``carried`` marks per input buffer
        the elements already written for the next iteration, which no task may touch after."""
        rec = self.t.tasks[tid]
        if rec["op"] < 0:
            return
        op = self.ops[int(rec["op"])]
        rect = op.tile_rect(int(rec["tile"]))
        index = tuple(slice(a, b) for a, b in rect)
        if writer is not None:
            for b, ids in self._inplace_ids(tid) if carried is not None else []:
                self._check_carried(carried, b, ids, tid, iteration)
            # in-place writes are recorded first, so a task reading what it appends itself is no race
            for b, ids in self._inplace_ids(tid):
                prev = writer[b][ids]
                if bool(((prev >= 0) & (prev != tid)).any()):
                    other = int(prev[(prev >= 0) & (prev != tid)][0])
                    raise RaceError(f"race in iteration {iteration}: {self._describe_task(tid)} and "
                                    f"{self._describe_task(other)} both write buffer "
                                    f"{self.t.meta['buffers'][b]['name']!r} in place")
                writer[b][ids] = tid
        keys = self.keys[int(rec["op"])]
        slices: list[torch.Tensor | None] = []
        for i, (v, region) in enumerate(zip(op.inputs, op.opdef.input_regions(op.sig, rect))):
            if region is None:
                slices.append(None)
                continue
            sl = tuple(slice(a, b) for a, b in region)
            buf = self.views[v][0]
            if writer is not None and carried is not None and buf in carried:
                self._check_carried(carried, buf, self._element_ids(v)[sl].reshape(-1), tid, iteration)
            if writer is not None and buf in self.key_shape and buf in self.planned:
                # the op's own keyed read, or (any other read of the buffer) the whole key space
                kr = keys[i].reads(op.sig, rect) if i in keys else None
                ids = self._key_ids(buf, kr) if kr is not None or i not in keys else torch.zeros(0, dtype=torch.int64)
                plan = self.planned[buf][ids]
                late = (plan >= 0) & (writer[buf][ids] < 0)
                if bool(late.any()):
                    key = tuple(int(c) for c in torch.unravel_index(ids[late.nonzero()[0, 0]], self.key_shape[buf]))
                    raise RaceError(
                        f"race in iteration {iteration}: {self._describe_task(tid)} read buffer "
                        f"{self.t.meta['buffers'][buf]['name']!r} at key {key} of its key space "
                        f"{self.key_shape[buf]} (OpDef.key_spaces), which {self._describe_task(int(plan[late][0]))} writes in place, "
                        f"before that task ran")
            elif writer is not None and writer[buf] is not None:
                ids = self._element_ids(v)[sl].reshape(-1)
                unwritten = writer[buf][ids] < 0
                if buf in self.planned:  # an input: only elements a task writes in place must wait
                    unwritten &= self.planned[buf][ids] >= 0
                if bool(unwritten.any()):
                    flat = int(ids[unwritten.nonzero()[0, 0]])
                    raise RaceError(
                        f"race in iteration {iteration}: {self._describe_task(tid)} read buffer "
                        f"{self.t.meta['buffers'][buf]['name']!r} {self._owner(buf, flat)}, before that task ran "
                        f"(its dependent event {int(rec['dep_event'])} does not cover the producer)")
            slices.append(self._view(bufs, v)[sl])
        result = op.opdef.cpu(op.sig, rect, slices)
        shape = tuple(b - a for a, b in rect)
        if tuple(result.shape) != shape:
            raise RuntimeError(f"{op.opdef.kind} kernel returned {tuple(result.shape)} for tile {rect}, expected {shape}")
        out = bufs[op.output].view(self.buf_shape[op.output])
        if writer is not None:
            ids = torch.arange(out.numel()).view(out.shape)[index].reshape(-1)
            prev = writer[op.output][ids]
            if bool((prev >= 0).any()):
                other = int(prev[prev >= 0][0])
                raise RaceError(f"race in iteration {iteration}: {self._describe_task(tid)} and "
                                f"{self._describe_task(other)} both write buffer "
                                f"{self.t.meta['buffers'][op.output]['name']!r}")
            writer[op.output][ids] = tid
            for b, ids in self._carried_ids(tid) if carried is not None else []:
                carried.setdefault(b, torch.zeros(math.prod(self.buf_shape[b]), dtype=torch.bool))[ids] = True
        out[index] = result

    def _check_carried(self, carried: dict[int, torch.Tensor], b: int, ids: torch.Tensor, tid: int,
                       iteration: int) -> None:
        if b in carried and bool(carried[b][ids].any()):
            raise RaceError(f"race in iteration {iteration}: {self._describe_task(tid)} touched buffer "
                            f"{self.t.meta['buffers'][b]['name']!r} after a task wrote its next iteration's value "
                            "(OpDef.carried_writes); expected it ordered before that writer")

    def run(self, args: Sequence[torch.Tensor], seed: int = 0, iterations: int = 1) -> list[Any]:
        """Run ``iterations`` iterations in one 'launch'; returns the graph outputs."""
        bufs = self._bind(args)
        for blocked in self.steps(bufs, seed, iterations):
            if blocked:  # only peers could wake it, and a lone interpreter has none
                raise DeadlockError("nothing is runnable; tasks wait on run-time data no task of this graph "
                                    "writes:\n  " + "\n  ".join(blocked))
        return self._outputs(bufs)

    def start(self, args: Sequence[torch.Tensor], seed: int = 0, iterations: int = 1):
        """(bound buffers, step generator) of a launch driven from outside (mpk.distributed.ranks
        interleaves ranks): see ``steps``; ``outputs(bufs)`` once it is exhausted."""
        bufs = self._bind(args)
        return bufs, self.steps(bufs, seed, iterations)

    def outputs(self, bufs) -> list[Any]:
        return self._outputs(bufs)

    def _waiting(self, t: int, bufs) -> str | None:
        """What ready task ``t`` waits for before it may run (OpDef.wait), or None."""
        rec = self.t.tasks[t]
        if rec["op"] < 0:
            return None
        op = self.ops[int(rec["op"])]
        if op.opdef.wait is None:
            return None
        rect = op.tile_rect(int(rec["tile"]))
        slices = [None if r is None else self._view(bufs, v)[tuple(slice(a, b) for a, b in r)]
                  for v, r in zip(op.inputs, op.opdef.input_regions(op.sig, rect))]
        why = op.opdef.wait(op.sig, rect, slices)
        return None if why is None else f"{self._describe_task(t)} waits for {why}"

    def steps(self, bufs, seed: int = 0, iterations: int = 1):
        """Run the launch one task per step: yields [] after each task, or, when every ready
        task waits on run-time data (OpDef.wait: a peer's signal), the list of what they wait
        for, without running anything (the caller lets peers progress, then resumes)."""
        rng = random.Random(seed)
        tasks, events = self.t.tasks, self.t.events
        if self.planned is None:
            self._plan_inplace()
        num_tasks = len(tasks)
        jit = (tasks["flags"] & FLAG_JIT) != 0
        queues = self.queues
        owner = {t: w for w, q in enumerate(queues) for t in q}
        unplaced = [t for t in range(num_tasks) if not jit[t] and t not in owner]
        if unplaced:  # tables not validated: name it rather than fail on a lookup
            raise ScheduleError(f"AOT {self._describe_task(unplaced[0])} is on no worker's queue "
                                f"({len(unplaced)} such tasks): it can never run")
        self.schedule = []
        counters = [0] * len(events)
        start, end = self.t.start_event, self.t.end_event
        for k in range(1, iterations + 1):
            writer = None
            if self.check_races:
                writer = [None if r["role"] == ROLE_INPUT else torch.full((b.numel(),), -1, dtype=torch.int64)
                          for r, b in zip(self.t.buffers, bufs)]
                for b, plan in self.planned.items():
                    writer[b] = torch.full_like(plan, -1)
            carried: dict[int, torch.Tensor] = {}
            released = [False] * num_tasks
            done = 0
            heads = [0] * self.num_workers
            ready: list[tuple[int, int]] = []  # (task, worker or -1 for JIT)

            def fire(e: int):
                lo, hi = int(events[e]["first_task"]), int(events[e]["last_task"])
                for t in range(lo, hi):
                    released[t] = True
                    if jit[t]:
                        ready.append((t, -1))
                    else:
                        w = owner[t]
                        if queues[w][heads[w]] == t:
                            ready.append((t, w))

            def arrive(e: int):
                counters[e] += 1
                if counters[e] == k * int(events[e]["num_triggers"]):
                    fire(e)

            arrive(start)
            while done < num_tasks:
                if not ready:
                    raise DeadlockError(self._deadlock_report(k, released, counters, queues, heads, done))
                if self.waits:
                    waits = [self._waiting(t, bufs) for t, _ in ready]
                    runnable = [i for i, why in enumerate(waits) if why is None]
                    if not runnable:
                        yield [f"iteration {k}: {why}" for why in waits]
                        continue
                    t, w = ready.pop(runnable[rng.randrange(len(runnable))])
                else:
                    t, w = ready.pop(rng.randrange(len(ready)))
                self.schedule.append((k, t, w))
                self._run_task(t, bufs, writer, k, carried)
                done += 1
                if w >= 0:
                    heads[w] += 1
                    if heads[w] < len(queues[w]) and released[queues[w][heads[w]]]:
                        ready.append((queues[w][heads[w]], w))
                arrive(int(tasks[t]["trig_event"]))
                yield []
            if counters[end] != k * int(events[end]["num_triggers"]) and num_tasks:
                raise DeadlockError(f"iteration {k}: all {num_tasks} tasks ran but the end event {end} "
                                    f"has {counters[end]} of {k * int(events[end]['num_triggers'])} arrivals")
            wrong = [e for e in range(len(events)) if counters[e] != k * int(events[e]["num_triggers"])]
            if wrong:
                e = wrong[0]
                raise ScheduleError(f"iteration {k}: event {e} got {counters[e]} arrivals, expected "
                                    f"{k * int(events[e]['num_triggers'])} (num_triggers disagrees with the "
                                    f"tasks that trigger it; {len(wrong)} event(s) affected)")
            if writer is not None:
                for b, w in enumerate(writer):
                    if w is not None and b not in self.planned and bool((w < 0).any()):
                        raise RaceError(f"iteration {k}: buffer {self.t.meta['buffers'][b]['name']!r} has "
                                        f"{int((w < 0).sum())} elements no task wrote")

    def _outputs(self, bufs) -> list[Any]:
        out = []
        for o in self.t.meta["outputs"]:
            out.append(self._view(bufs, o["view"]) if "view" in o else o["value"])
        return out

    def _deadlock_report(self, k, released, counters, queues, heads, done) -> str:
        tasks, events = self.t.tasks, self.t.events
        pending = [t for t in range(len(tasks)) if not released[t]]
        lines = [f"deadlock in iteration {k}: {done} of {len(tasks)} tasks ran, nothing is runnable."]
        waits = {}
        for t in pending:
            waits.setdefault(int(tasks[t]["dep_event"]), []).append(t)
        for e, ts in list(waits.items())[:10]:
            need = k * int(events[e]["num_triggers"])
            lines.append(f"  event {e}: {counters[e]}/{need} arrivals; waiting tasks {ts[:6]}"
                         f"{' …' if len(ts) > 6 else ''} ({self._describe_task(ts[0])})")
        blocked = [(w, q[heads[w]]) for w, q in enumerate(queues) if heads[w] < len(q) and not released[q[heads[w]]]]
        for w, t in blocked[:10]:
            behind = [u for u in queues[w][heads[w] + 1:] if released[u]]
            lines.append(f"  worker {w} blocked on AOT {self._describe_task(t)} waiting for event "
                         f"{int(tasks[t]['dep_event'])}" + (f"; released tasks queued behind it: {behind[:6]}"
                                                            f"{' …' if len(behind) > 6 else ''}" if behind else ""))
        return "\n".join(lines)
