"""Step 7 — emit: the flat, versioned tables. THE contract between the compiler and both
executors (the persistent GPU kernel and the CPU interpreter); nothing else crosses over.

Layout, version 2 (little-endian, all ids 0-based, task/event ids are linear positions):

``tasks`` (TASK_DTYPE, 20 bytes per task)
    op          int32   index into ``ops``, or -1 for a dummy task (no work)
    tile        int32   row-major tile index within the op's grid
    dep_event   int32   the one event the task waits on
    trig_event  int32   the one event the task increments when done
    flags       uint32  bit 0: JIT (dispatched by a scheduler) else AOT (pre-queued)
``events`` (EVENT_DTYPE)
    num_triggers int32  arrivals per iteration; iteration k (1-based) fires at k·num_triggers
                        (counters are never reset inside a launch)
    first_task, last_task int32   launched task range [first_task, last_task)
    flags       uint32  bit 0: global barrier (closes a JIT region: every JIT task linearized
                        before it is its ancestor)
``ops`` (OP_DTYPE): type_id (registry), output buffer, first_input/num_inputs into
    ``op_inputs`` (view ids), ndim, grid[MAX_DIMS], bounds_offset into ``bounds`` (per dim,
    grid[d]+1 boundaries, dims concatenated), num_tiles. An op's tasks need not be contiguous
    in linear order; a task finds its tile as ``tasks.tile`` within its op's grid.
``buffers`` (BUFFER_DTYPE): role (0 input, 1 intermediate), dtype code (DTYPES), ndim,
    shape[MAX_DIMS], input_index (argument position for inputs, -1 otherwise).
``views`` (VIEW_DTYPE): buffer, ndim, offset, shape[MAX_DIMS], strides[MAX_DIMS] in elements
    over the contiguous buffer.
``op_inputs`` int32, ``bounds`` int64.
``worker_offsets`` int32 [num_workers + 1], ``worker_tasks`` int32 (step 7a, place): worker w
    runs the AOT tasks ``worker_tasks[worker_offsets[w]:worker_offsets[w + 1]]`` in that order,
    each once its dep_event fired; a worker whose head task waits runs none of its later ones.
    Every AOT task appears exactly once, no JIT task appears, and each queue is in increasing
    linear order (so no worker waits on a task queued behind it). JIT tasks run on any worker.
``meta`` (JSON): version, start/end event ids, per-op kind / name / attrs / source, buffer
    names, graph outputs (view id or a JSON constant), the options that shaped the tables, and
    ``placement``: ``num_workers`` (worker CTAs, ids 0…num_workers−1), ``scheduler_ctas`` (CTAs
    launched after the workers, each with mpk.compiler.place.SCHED_WARPS_PER_CTA scheduler
    warps) and ``scheduler_warps`` (those that own workers: warp s hands JIT tasks to workers
    w ≡ s mod scheduler_warps; ≥ 1 when there are JIT tasks). One launch is num_workers +
    scheduler_ctas co-resident CTAs; executors run this placement and decide none of their own.

``Tables.to_bytes`` is deterministic (no timestamps, sorted JSON), so equal inputs give
byte-identical tables; ``digest`` is its sha256.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mpk.compiler.place import MAX_WORKERS_PER_SCHEDULER, SCHED_WARPS_PER_CTA, placement
from mpk.compiler.taskgraph import TaskGraph
from mpk.errors import CompileError
from mpk.ir.views import View
from mpk.ops import OpSig, get_op

TABLES_VERSION = 2
MAX_DIMS = 8
MAGIC = b"MPKTBL01"
FLAG_JIT = 1
FLAG_BARRIER = 1
ROLE_INPUT, ROLE_INTERMEDIATE = 0, 1

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}

TASK_DTYPE = np.dtype([("op", "<i4"), ("tile", "<i4"), ("dep_event", "<i4"), ("trig_event", "<i4"),
                       ("flags", "<u4")])
EVENT_DTYPE = np.dtype([("num_triggers", "<i4"), ("first_task", "<i4"), ("last_task", "<i4"),
                        ("flags", "<u4")])
OP_DTYPE = np.dtype([("type_id", "<i4"), ("output", "<i4"), ("first_input", "<i4"), ("num_inputs", "<i4"),
                     ("ndim", "<i4"), ("grid", "<i4", (MAX_DIMS,)), ("bounds_offset", "<i4"),
                     ("num_tiles", "<i4")])
BUFFER_DTYPE = np.dtype([("role", "<i4"), ("dtype", "<i4"), ("ndim", "<i4"), ("shape", "<i8", (MAX_DIMS,)),
                         ("input_index", "<i4")])
VIEW_DTYPE = np.dtype([("buffer", "<i4"), ("ndim", "<i4"), ("offset", "<i8"), ("shape", "<i8", (MAX_DIMS,)),
                       ("strides", "<i8", (MAX_DIMS,))])
# op attrs that name the rank of a tensor-parallel graph (mpk.distributed.shard)
RANK_ATTRS = ("rank", "vocab_start")
ARRAYS = {"tasks": TASK_DTYPE, "events": EVENT_DTYPE, "ops": OP_DTYPE, "buffers": BUFFER_DTYPE,
          "views": VIEW_DTYPE, "op_inputs": np.dtype("<i4"), "bounds": np.dtype("<i8"),
          "worker_offsets": np.dtype("<i4"), "worker_tasks": np.dtype("<i4")}


@dataclass
class Tables:
    tasks: np.ndarray
    events: np.ndarray
    ops: np.ndarray
    buffers: np.ndarray
    views: np.ndarray
    op_inputs: np.ndarray
    bounds: np.ndarray
    worker_offsets: np.ndarray
    worker_tasks: np.ndarray
    meta: dict[str, Any]

    @property
    def start_event(self) -> int:
        return self.meta["start_event"]

    @property
    def end_event(self) -> int:
        return self.meta["end_event"]

    @property
    def num_workers(self) -> int:
        return int(self.meta["placement"]["num_workers"])

    @property
    def scheduler_ctas(self) -> int:
        return int(self.meta["placement"]["scheduler_ctas"])

    @property
    def scheduler_warps(self) -> int:
        return int(self.meta["placement"]["scheduler_warps"])

    def worker_queues(self) -> list[list[int]]:
        """Each worker's AOT tasks in the order it runs them."""
        off = self.worker_offsets
        return [self.worker_tasks[off[w]: off[w + 1]].tolist() for w in range(self.num_workers)]

    def to_bytes(self) -> bytes:
        header = json.dumps({"meta": self.meta, "counts": {k: len(getattr(self, k)) for k in ARRAYS}},
                            sort_keys=True, separators=(",", ":")).encode()
        body = b"".join(np.ascontiguousarray(getattr(self, k), dtype=dt).tobytes() for k, dt in ARRAYS.items())
        return MAGIC + len(header).to_bytes(8, "little") + header + body

    @classmethod
    def from_bytes(cls, data: bytes) -> "Tables":
        if data[:8] != MAGIC:
            raise CompileError(f"not an mpk tables file (magic {data[:8]!r}, expected {MAGIC!r})")
        n = int.from_bytes(data[8:16], "little")
        header = json.loads(data[16:16 + n])
        if header["meta"]["version"] != TABLES_VERSION:
            raise CompileError(f"tables version {header['meta']['version']}, this mpk reads {TABLES_VERSION}")
        pos, arrays = 16 + n, {}
        for k, dt in ARRAYS.items():
            count = header["counts"][k]
            arrays[k] = np.frombuffer(data, dtype=dt, count=count, offset=pos).copy()
            pos += count * dt.itemsize
        return cls(meta=header["meta"], **arrays)

    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def rank_free_digest(self) -> str:
        """``digest`` with what names the rank left out: the ``tensor_parallel`` option's rank
        and the ops' rank-dependent attrs (``RANK_ATTRS``: a collective's rank, the embedding
        shard's first row). The ranks of one job then compile
        equal digests (their shards differ in weights and run-time inputs only), so equal
        digests across ranks mean they run one graph."""
        tp = self.meta.get("options", {}).get("tensor_parallel")
        if tp is None:
            return self.digest()
        ops = [dict(o, attrs={k: ("*" if k in RANK_ATTRS else v) for k, v in o.get("attrs", {}).items()})
               for o in self.meta.get("ops", [])]
        meta = dict(self.meta, ops=ops, options=dict(self.meta["options"], tensor_parallel=["*", tp[1]]))
        return hashlib.sha256(Tables(meta=meta, **{k: getattr(self, k) for k in ARRAYS}).to_bytes()).hexdigest()


def _json_value(x):
    if isinstance(x, torch.dtype):
        return str(x)[6:]
    if isinstance(x, (list, tuple)):
        return [_json_value(y) for y in x]
    if isinstance(x, dict):
        return {k: _json_value(v) for k, v in x.items()}
    return x


def emit(tg: TaskGraph, options: dict[str, Any] | None = None) -> Tables:
    """The tables of ``tg`` after steps 1–6 and 7a. A task graph not placed yet is placed here
    with ``options``' num_workers and scheduler_ctas, as CompileOptions defaults them (without
    num_workers the launch fills the device)."""
    graph = tg.graph
    if tg.placement is None:
        from mpk.compiler.place import place
        from mpk.options import default_num_workers, device_sms

        opts = options or {}
        n, sched = opts.get("num_workers"), opts.get("scheduler_ctas")
        place(tg, n or default_num_workers(sched), sched, None if n else device_sms())
    new_task = {old: new for new, old in enumerate(tg.task_order)}
    new_event = {old: new for new, old in enumerate(tg.event_order)}

    events = np.zeros(len(tg.events), EVENT_DTYPE)
    dep_event = [0] * tg.num_tasks
    trig_event = [0] * tg.num_tasks
    for old, e in enumerate(tg.events):
        ne = new_event[old]
        ids = [new_task[t] for t in e.launches]
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise CompileError(f"event {ne} launches non-contiguous tasks {ids[:8]}…")
        first = ids[0] if ids else (len(tg.task_order) if old == tg.end_event else 0)
        events[ne] = (max(1, len(e.triggers)), first, first + len(ids), FLAG_BARRIER if tg.barrier[old] else 0)
        for t in e.launches:
            dep_event[t] = ne
        for t in e.triggers:
            trig_event[t] = ne

    tasks = np.zeros(tg.num_tasks, TASK_DTYPE)
    for new, old in enumerate(tg.task_order):
        tasks[new] = (tg.task_op[old], tg.task_tile[old], dep_event[old], trig_event[old],
                      FLAG_JIT if tg.jit[old] else 0)

    views: list[View] = []
    view_id: dict[View, int] = {}

    def add_view(v: View) -> int:
        if v not in view_id:
            view_id[v] = len(views)
            views.append(v)
        return view_id[v]

    ops = np.zeros(len(graph.ops), OP_DTYPE)
    op_inputs: list[int] = []
    bounds: list[int] = []
    for t in tg.tiles:
        op = graph.ops[t.op_id]
        if len(t.grid) > MAX_DIMS:
            raise CompileError(f"op {op.name!r} has a {len(t.grid)}-d output; tables hold at most {MAX_DIMS} dims")
        grid = list(t.grid) + [1] * (MAX_DIMS - len(t.grid))
        ops[op.id] = (get_op(op.kind).type_id, op.output, len(op_inputs), len(op.inputs), len(t.grid),
                      grid, len(bounds), t.num_tasks)
        op_inputs += [add_view(v) for v in op.inputs]
        for b in t.bounds:
            bounds += b
    outputs = []
    for o in graph.outputs:
        outputs.append({"view": add_view(o.view)} if o.view is not None else {"value": _json_value(o.value)})

    buffers = np.zeros(len(graph.buffers), BUFFER_DTYPE)
    for b in graph.buffers:
        if len(b.shape) > MAX_DIMS:
            raise CompileError(f"buffer {b.name!r} is {len(b.shape)}-d; tables hold at most {MAX_DIMS} dims")
        if b.dtype not in DTYPE_CODE:
            raise CompileError(f"buffer {b.name!r} has dtype {b.dtype}; supported: {[str(d) for d in DTYPES]}")
        buffers[b.id] = (ROLE_INPUT if b.role == "input" else ROLE_INTERMEDIATE, DTYPE_CODE[b.dtype], len(b.shape),
                         list(b.shape) + [0] * (MAX_DIMS - len(b.shape)),
                         b.input_index if b.input_index is not None else -1)

    view_arr = np.zeros(len(views), VIEW_DTYPE)
    for i, v in enumerate(views):
        strides, offset = v.strided()
        pad = [0] * (MAX_DIMS - v.ndim)
        view_arr[i] = (v.buffer, v.ndim, offset, list(v.shape) + pad, list(strides) + pad)

    meta = {
        "version": TABLES_VERSION,
        "start_event": new_event[tg.start_event],
        "end_event": new_event[tg.end_event],
        "ops": [{"kind": op.kind, "name": op.name, "attrs": _json_value(op.attrs), "source": op.source}
                for op in graph.ops],
        "buffers": [{"name": b.name, "is_param": b.is_param} for b in graph.buffers],
        "outputs": outputs,
        "options": _json_value(options or {}),
        "placement": tg.placement.meta(),
    }
    return Tables(tasks, events, ops, buffers, view_arr, np.array(op_inputs, "<i4"),
                  np.array(bounds, "<i8"), tg.placement.worker_offsets.astype("<i4"),
                  tg.placement.worker_tasks.astype("<i4"), meta)


def view_of(flat: torch.Tensor, shape, strides, offset: int) -> torch.Tensor:
    """A tables view — ``shape``, ``strides`` and ``offset`` in elements from the start of its
    buffer — of ``flat``, the contiguous tensor bound to that buffer. ``flat`` may start inside its
    storage (an argument that is a slice or a row of a larger tensor), so the offset is taken
    from its start, not the storage's."""
    return flat.as_strided(shape, strides, flat.storage_offset() + offset)


def buffer_layouts(tables: Tables) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    """Every buffer's shape and dtype, in buffer order."""
    return ([tuple(int(s) for s in b["shape"][: b["ndim"]]) for b in tables.buffers],
            [DTYPES[b["dtype"]] for b in tables.buffers])


@dataclass(frozen=True)
class OpLayout:
    """One op as the tables hold it: its input view ids, output buffer, grid, each dim's tile
    boundaries, and its signature (input view shapes, output shape and dtype, attrs)."""

    inputs: list[int]
    output: int
    grid: tuple[int, ...]
    bounds: list[tuple[int, ...]]
    sig: OpSig


def op_layout(tables: Tables, i: int) -> OpLayout:
    """Op ``i``'s ``OpLayout``."""
    views, o = tables.views, tables.ops[i]
    ins = [int(x) for x in tables.op_inputs[o["first_input"]: o["first_input"] + o["num_inputs"]]]
    grid = tuple(int(g) for g in o["grid"][: int(o["ndim"])])
    bounds, pos = [], int(o["bounds_offset"])
    for g in grid:
        bounds.append(tuple(int(b) for b in tables.bounds[pos: pos + g + 1]))
        pos += g + 1
    buf = tables.buffers[int(o["output"])]
    sig = OpSig(tuple(tuple(int(s) for s in views[v]["shape"][: views[v]["ndim"]]) for v in ins),
                tuple(int(s) for s in buf["shape"][: buf["ndim"]]), DTYPES[int(buf["dtype"])],
                tables.meta["ops"][i]["attrs"])
    return OpLayout(ins, int(o["output"]), grid, bounds, sig)


def op_layouts(tables: Tables) -> list[OpLayout]:
    """Every op's ``OpLayout``, in op order (what the executors and the verifier read per op)."""
    return [op_layout(tables, i) for i in range(len(tables.ops))]


def carried_buffers(tables: Tables) -> frozenset[int]:
    """The graph-input buffers an op rewrites for the next iteration (``OpDef.carried_writes``:
    the start-of-iteration task's tokens and page table): a task must not read them before its
    event fires, when they may still hold the previous iteration's values."""
    from mpk.ops import REGISTRY, op_by_type_id

    kinds = [d.type_id for d in REGISTRY.values() if d.carried_writes is not None]
    out: set[int] = set()
    for i in np.nonzero(np.isin(tables.ops["type_id"], kinds))[0].tolist():
        lay = op_layout(tables, i)
        whole = tuple((0, n) for n in lay.sig.out_shape)
        for j, _ in op_by_type_id(int(tables.ops[i]["type_id"])).carried_writes(lay.sig, whole):
            out.add(int(tables.views[lay.inputs[j]]["buffer"]))
    return frozenset(out)


def check_argument(tables: Tables, buffer: int, arg: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise ValueError naming the argument bound to input ``buffer`` unless it is a tensor of
    ``shape`` and ``dtype``."""
    if isinstance(arg, torch.Tensor) and tuple(arg.shape) == shape and arg.dtype == dtype:
        return
    got = f"{tuple(arg.shape)} {arg.dtype}" if isinstance(arg, torch.Tensor) else type(arg).__name__
    raise ValueError(f"argument {int(tables.buffers[buffer]['input_index'])} "
                     f"({tables.meta['buffers'][buffer]['name']}) is {got}, expected {shape} {dtype}")


def validate(tables: Tables) -> None:
    """Check the structural invariants both executors rely on; raises CompileError naming the
    offending task or event. Event ranges partition the tasks in order, each task's dep_event
    is the event whose range holds it, trigger counts match, every event launches only tasks
    linearized after all of its triggers (topological order), events are numbered in the order
    of their ranges, and the end event is last."""
    tasks, events = tables.tasks, tables.events
    n = len(tasks)
    start, end = tables.start_event, tables.end_event
    covered = 0
    for e, r in enumerate(events):
        lo, hi = int(r["first_task"]), int(r["last_task"])
        if not 0 <= lo <= hi <= n:
            raise CompileError(f"event {e} launches [{lo}, {hi}) outside the {n} tasks")
        deps = tasks["dep_event"][lo:hi]
        if (deps != e).any():
            t = lo + int((deps != e).nonzero()[0][0])
            raise CompileError(f"task {t} lies in event {e}'s range but depends on event {int(tasks['dep_event'][t])}")
        covered += hi - lo
    if covered != n:
        raise CompileError(f"event ranges cover {covered} task slots for {n} tasks (each task exactly once)")
    counts = np.bincount(tasks["trig_event"], minlength=len(events)) if n else np.zeros(len(events), int)
    for e, r in enumerate(events):
        expected = 1 if e == start else int(counts[e])
        if e != start and counts[e] == 0 and e != end:
            raise CompileError(f"event {e} has no triggering task: it can never fire")
        if int(r["num_triggers"]) != max(1, expected):
            raise CompileError(f"event {e} expects {int(r['num_triggers'])} triggers, {expected} tasks trigger it")
        if e == start and counts[e]:
            raise CompileError(f"start event {e} is triggered by tasks; only the runtime triggers it")
    for t in range(n):
        trig = int(tasks["trig_event"][t])
        if trig != end and int(events[trig]["first_task"]) <= t:
            raise CompileError(f"task {t} triggers event {trig}, which launches tasks from "
                               f"{int(events[trig]['first_task'])}: not after the task (order not topological)")
    if int(events[end]["first_task"]) != n:
        raise CompileError(f"end event {end} launches from task {int(events[end]['first_task'])}; expected "
                           f"nothing: its range must start at the end of the task list ({n})")
    firsts = events["first_task"].astype(np.int64)
    if len(firsts) > 1 and (np.diff(firsts) < 0).any():
        e = int(np.nonzero(np.diff(firsts) < 0)[0][0]) + 1
        raise CompileError(f"event {e} launches from task {int(firsts[e])}, before event {e - 1}'s range: events "
                           "must be numbered in linear order (the GPU schedulers rely on it)")
    validate_placement(tables)


def validate_placement(tables: Tables) -> None:
    """Check the placement (step 7a) against the tasks: counts in range, worker_offsets a CSR
    over worker_tasks, every AOT task queued exactly once, no JIT task queued, each queue in
    increasing linear order; raises CompileError naming the offending worker or task."""
    p = tables.meta.get("placement")
    if not isinstance(p, dict) or {"num_workers", "scheduler_ctas", "scheduler_warps"} - set(p):
        raise CompileError(f"the tables' meta has no placement (num_workers, scheduler_ctas, scheduler_warps): {p!r}")
    W, C, S = tables.num_workers, tables.scheduler_ctas, tables.scheduler_warps
    n_jit = int(((tables.tasks["flags"] & FLAG_JIT) != 0).sum())
    if W < 1 or C < 0 or not 0 <= S <= min(C * SCHED_WARPS_PER_CTA, W):
        raise CompileError(f"placement of {W} workers, {C} scheduler CTAs, {S} scheduler warps: expected "
                           f"num_workers >= 1 and 0 <= scheduler_warps <= min({SCHED_WARPS_PER_CTA}·scheduler_ctas, "
                           "num_workers)")
    if n_jit and S < 1:
        raise CompileError(f"{n_jit} JIT tasks but no scheduler warp to hand them out")
    if S and -(-W // S) > MAX_WORKERS_PER_SCHEDULER:
        raise CompileError(f"{W} workers over {S} scheduler warps exceeds {MAX_WORKERS_PER_SCHEDULER} per warp")
    off, queued = tables.worker_offsets, tables.worker_tasks
    if len(off) != W + 1 or (len(off) and (off[0] != 0 or off[-1] != len(queued))) or (np.diff(off) < 0).any():
        raise CompileError(f"worker_offsets {off[:8].tolist()}… is not a CSR over {len(queued)} queued tasks "
                           f"for {W} workers (length {W + 1}, from 0, non-decreasing, to {len(queued)})")
    n = len(tables.tasks)
    if len(queued) and (queued.min() < 0 or queued.max() >= n):
        raise CompileError(f"worker_tasks holds task {int(queued.min() if queued.min() < 0 else queued.max())} "
                           f"outside the {n} tasks")
    times = np.bincount(queued, minlength=n) if n else np.zeros(0, int)
    jit = (tables.tasks["flags"] & FLAG_JIT) != 0
    for t in np.nonzero((times != (~jit).astype(int)))[0][:1].tolist():
        what = "a JIT task" if jit[t] else "an AOT task"
        raise CompileError(f"task {t} is {what} and is queued on {int(times[t])} workers; expected "
                           f"{0 if jit[t] else 1}")
    for w in range(W):
        q = queued[off[w]: off[w + 1]]
        if len(q) > 1 and (np.diff(q) <= 0).any():
            i = int(np.nonzero(np.diff(q) <= 0)[0][0])
            raise CompileError(f"worker {w} queues task {int(q[i])} before task {int(q[i + 1])}: queues must be "
                               "in increasing linear order (a worker could wait on a task queued behind it)")


def place_tables(tables: Tables, num_workers: int, scheduler_ctas: int | None = None) -> Tables:
    """Emitted ``tables`` placed anew (a copy sharing the other arrays): for tables whose task
    modes changed after emit (``mpk.testing.random_graphs.force_jit``) and for runs of one
    graph on several worker counts (runtime tests and benchmarks). Round-robin only: the tables
    keep no tile costs, so an op the compiler dealt by cost (``OpDef.tile_cost``) is not."""
    p = placement((tables.tasks["flags"] & FLAG_JIT) != 0, num_workers, scheduler_ctas)
    return replace(tables, worker_offsets=p.worker_offsets, worker_tasks=p.worker_tasks,
                   meta={**tables.meta, "placement": p.meta()})
