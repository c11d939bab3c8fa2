"""The GPU executor: tables → generated CUDA → cubin (cached) → one cooperative launch.

``GpuExecutor(tables).run(args, iterations=k)`` binds the inputs, runs k iterations of the
task graph inside ONE persistent kernel and returns the graph outputs. Every launch, waited on
or not, is watched by the executor's watchdog thread (mpk/executors/watchdog.py): past
``timeout_s`` it reads what each worker and scheduler waits on, sets the abort flag that
every wait loop of the kernel observes, so the kernel exits and the process stays usable (the
graph's intermediate buffers then hold partial results), and files its report
(mpk/executors/report.py); the next call of the executor (``launch``, ``run``, ``wait``,
``outputs``) raises it as ``WatchdogTimeout``.
"""

from __future__ import annotations

import ctypes
import json
import operator
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from mpk.compiler.place import SCHED_WARPS_PER_CTA
from mpk.compiler.tables import (
    FLAG_JIT,
    ROLE_INPUT,
    Tables,
    buffer_layouts,
    check_argument,
    validate,
    validate_placement,
    view_of,
)
from mpk.errors import BadInputError, ExecutorUnavailableError, MpkError, bad_input_message
from mpk.executors import cuda_driver as drv
from mpk.executors.build import build_cubin
from mpk.executors.codegen import aligned_inputs, dynamic_smem_bytes, generate
from mpk.executors.report import STATUS_WORDS, ReportTables, Snapshot, format_report
from mpk.executors.watchdog import Watchdog
from mpk.ops.linalg import op_form

THREADS = 256
PROFILE_WORDS = 5  # runtime/mpk_runtime/types.cuh: ProfileRecord, in 8-byte words
SNAPSHOT_WAIT_S = 1.0  # how long the watchdog waits for its copy of a hung launch's device state
EVENT_HAS_JIT, EVENT_ALL_JIT, EVENT_LOCAL_JIT = 2, 4, 8
# What executors dropped while their last launch ran still own (module, mapped status words,
# buffers), with that launch's done-event: kept until the event completes, since the kernel
# uses them until then (a launch that never ends keeps them for good).
_DROPPED: list[tuple[torch.cuda.Event, list[Any]]] = []


# every executor of the process, for abort_all (weakly: an executor's life is its runner's)
_LIVE: "weakref.WeakSet[GpuExecutor]" = weakref.WeakSet()
ABORT_ALL = 2**31 - 1  # an abort-flag value past every epoch: the launch in flight and all later ones stop


def abort_all() -> None:
    """Stop every launch in flight, and every later one, of every GPU executor of this process
    (a tensor-parallel peer died: the signals its launches wait for will never come). The
    kernels return at their next wait; their outputs must not be read."""
    for ex in list(_LIVE):
        ex.h_abort.array[0] = ABORT_ALL


def _release_dropped() -> None:
    _DROPPED[:] = [(done, held) for done, held in _DROPPED if not done.query()]


# what a bind records of each argument, taken by C-level passes over the arguments (map): a
# decode step has a few hundred, and a Python loop over them would be a visible share of each launch
_KEYS = (torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride, operator.attrgetter("dtype"))


class _Args(ctypes.Structure):
    """Mirror of mpk::RuntimeArgs (runtime/mpk_runtime/types.cuh); unknown fields are refused."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "tasks", "events", "counters", "aot_offsets", "aot_entries", "task_infos", "jit_events", "mailbox",
        "jit_values", "jit_seq", "jit_head", "done", "status", "abort_flag", "profile", "profile_count", "running")] + [
        (n, ctypes.c_int) for n in (
        "profile_capacity", "num_workers", "num_schedulers", "active_schedulers", "num_tasks", "num_events",
        "num_jit_events", "start_jit_index", "start_event", "end_event", "iterations", "any_jit", "jit_capacity",
        "epoch")]

    def __init__(self, **kw):
        unknown = set(kw) - {name for name, _ in self._fields_}
        if unknown:
            raise TypeError(f"RuntimeArgs has no fields {sorted(unknown)}")
        super().__init__(**kw)


def _pow2(n: int) -> int:
    return 1 << max(4, (max(1, n) - 1).bit_length())


def _dev(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()).to(device)


def check_device_fits(tables: Tables, sms: int, device: str = "the device") -> None:
    """ExecutorUnavailableError unless the tables' workers and scheduler CTAs fit one
    cooperative launch on ``sms`` SMs (one resident CTA per SM: the kernel is built for it)."""
    W, C = tables.num_workers, tables.scheduler_ctas
    if W + C <= sms:
        return
    fix = f"compile with options num_workers <= {sms - C}" if sms > C else "compile with fewer scheduler_ctas"
    if C and sms > C:
        fix += f" (or fewer scheduler_ctas than {C})"
    raise ExecutorUnavailableError(
        f"the tables place {W} workers + {C} scheduler CTAs = {W + C} CTAs in one cooperative launch, but "
        f"{device} has {sms} SMs (one resident CTA each); {fix}")


def jit_ring_capacity(jit_events: np.ndarray, num_workers: int, active_schedulers: int) -> int:
    """Pushes one worker's ring can receive in one iteration, at most: a scheduler hands each
    of its workers at most one task per chunk of min(its workers, 32) tasks of an event."""
    S, W = active_schedulers, num_workers
    spans = (jit_events[:, 2] - jit_events[:, 1]).astype(np.int64)
    worst = 0
    for s in range(S):
        mine = (W - s + S - 1) // S
        count = np.where(spans > s, (spans - s + S - 1) // S, 0)
        worst = max(worst, int((-(-count // min(mine, 32))).sum()))
    return _pow2(worst)


class HostLayout:
    """The tables in the device structs' layout (runtime/mpk_runtime/types.cuh), as host
    arrays: a format change only; the placement is the tables' (``aot_offsets`` and the tasks
    of ``aot_entries`` are ``worker_offsets`` and ``worker_tasks``)."""

    def __init__(self, t: Tables, local_jit: bool = True):
        validate_placement(t)
        n_tasks, n_events = len(t.tasks), len(t.events)
        jit = (t.tasks["flags"] & FLAG_JIT) != 0
        events = t.events.copy()
        for e in range(n_events):
            lo, hi = int(events[e]["first_task"]), int(events[e]["last_task"])
            if jit[lo:hi].any():
                events[e]["flags"] |= EVENT_HAS_JIT
            if hi > lo and jit[lo:hi].all():
                events[e]["flags"] |= EVENT_ALL_JIT
            # one JIT task: the worker whose arrival fires the event runs it (no scheduler hops);
            # not the start event, which the host announces to the schedulers
            if local_jit and hi - lo == 1 and jit[lo] and e != t.start_event:
                events[e]["flags"] |= EVENT_LOCAL_JIT
        self.num_workers, self.scheduler_ctas = t.num_workers, t.scheduler_ctas
        self.num_schedulers = t.scheduler_ctas * SCHED_WARPS_PER_CTA  # warps launched (status rows)
        self.active_schedulers = t.scheduler_warps  # the ones that own workers
        self.any_jit = bool(jit.any())
        self.events = events  # with the flags the host sets (types.cuh: EventDesc)
        self.aot_offsets = t.worker_offsets.astype(np.int32)
        # JIT events (types.cuh: JitEvent) in event order; EventRef.jit_index points into them
        jit_ids = np.nonzero(events["flags"] & EVENT_HAS_JIT)[0]
        jit_index = np.full(n_events, -1, np.int32)
        jit_index[jit_ids] = np.arange(len(jit_ids), dtype=np.int32)
        jit_events = np.zeros((max(1, len(jit_ids)), 4), np.int32)
        jit_events[: len(jit_ids), 0] = jit_ids
        jit_events[: len(jit_ids), 1] = events["first_task"][jit_ids]
        jit_events[: len(jit_ids), 2] = events["last_task"][jit_ids]
        jit_events[: len(jit_ids), 3] = events["flags"][jit_ids].astype(np.int32)
        self.jit_events, self.num_jit_events = jit_events, len(jit_ids)
        self.start_jit_index = int(jit_index[t.start_event])
        # TaskInfo (12 int32: task, op, tile, iter (0: set at run time), then the trigger event's
        # EventRef: id, num_triggers, first, last, flags, jit_index, pad×2) and AotEntry (TaskInfo,
        # dep, dep's num_triggers, pad×2)
        infos = np.zeros((max(1, n_tasks), 12), np.int32)
        if n_tasks:
            trig = t.tasks["trig_event"]
            infos[:n_tasks, 0], infos[:n_tasks, 1], infos[:n_tasks, 2] = np.arange(n_tasks), t.tasks["op"], t.tasks["tile"]
            infos[:n_tasks, 4], infos[:n_tasks, 5] = trig, events["num_triggers"][trig]
            infos[:n_tasks, 6], infos[:n_tasks, 7] = events["first_task"][trig], events["last_task"][trig]
            infos[:n_tasks, 8] = events["flags"][trig].astype(np.int32)
            infos[:n_tasks, 9] = jit_index[trig]
        order = t.worker_tasks.astype(np.int64)
        entries = np.zeros((max(1, len(order)), 16), np.int32)
        if len(order):
            dep = t.tasks["dep_event"][order]
            entries[: len(order), :12] = infos[order]
            entries[: len(order), 12], entries[: len(order), 13] = dep, events["num_triggers"][dep]
        self.task_infos, self.aot_entries = infos, entries
        W, S = self.num_workers, self.active_schedulers
        self.jit_capacity = jit_ring_capacity(jit_events[: self.num_jit_events], W, S)

    def worker_queues(self) -> list[list[int]]:
        """Each worker's AOT tasks in the order the kernel runs them (from the device arrays)."""
        off = self.aot_offsets
        return [self.aot_entries[off[w]: off[w + 1], 0].tolist() for w in range(self.num_workers)]


def _query(done: torch.cuda.Event, device: int):
    """``done.query`` callable from any thread (the watchdog's makes the device current first)."""

    def query() -> bool:
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
        return done.query()

    return query


class _GpuProbe:
    """What the watchdog does to a launch of one executor (mpk/executors/watchdog.py: Probe),
    holding what it needs of the executor but not the executor, so that dropping the executor
    ends its watchdog. A launch is (epoch, iterations)."""

    def __init__(self, ex: GpuExecutor):
        self.h_status, self.h_abort, self.num_workers, self.timeout_s = ex.h_status, ex.h_abort, ex.num_workers, \
            ex.timeout_s
        self.tables = ReportTables.from_tables(ex.t, ex.layout.worker_queues(),
                                               ex.layout.jit_events[: ex.layout.num_jit_events, 0].tolist())
        n_events = len(ex.t.events)
        self.d_zero, self.d_running = ex.d_zero, ex.d_running  # held: the copies read them
        self.counters_ptr, self.n_events = ex.zero_ptr["counters"], n_events
        # pinned host memory the copies land in: the running words, then the counters
        self.h_device = drv.MappedHostBuffer(2 * (self.num_workers + max(1, n_events)))
        self.context = drv.current_context()
        self.stream = drv.Stream()

    def snapshot(self, launch: tuple[int, int]) -> Snapshot:
        """The status rows as the hung launch left them, and its counters and running words read
        from device memory on a stream of its own while it still runs (the copy engine does not
        wait for the kernel; bounded by SNAPSHOT_WAIT_S all the same)."""
        epoch, _ = launch
        status = self.h_status.array.reshape(-1, STATUS_WORDS).copy()
        snap = Snapshot(epoch=epoch, status=status, num_workers=self.num_workers)
        drv.set_current_context(self.context)
        W, host = self.num_workers, self.h_device.host.value
        drv.copy_to_host_async(host, self.d_running.data_ptr(), 8 * W, self.stream)
        drv.copy_to_host_async(host + 8 * W, self.counters_ptr, 8 * self.n_events, self.stream)
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        while not self.stream.query():
            if time.monotonic() > deadline:
                return snap  # the report says the counters are the waiters' last view
            time.sleep(0.0005)
        words = self.h_device.array.view(np.int64)
        snap.running, snap.counters = words[:W].copy(), words[W: W + self.n_events].copy()
        return snap

    def abort(self, launch: tuple[int, int]) -> None:
        """Stop this launch and any queued before it; launches queued after it run (the flag holds
        the latest stopped launch's number and is never reset, so no reset races a queued launch)."""
        epoch, _ = launch
        self.h_abort.array[0] = max(int(self.h_abort.array[0]), epoch)

    def report(self, launch: tuple[int, int], snap: Snapshot | Exception, exited: bool) -> str:
        epoch, iterations = launch
        if isinstance(snap, Exception):  # the rows are host memory: only the device copy can fail
            snap = Snapshot(epoch=epoch, status=self.h_status.array.reshape(-1, STATUS_WORDS).copy(),
                            num_workers=self.num_workers)
        return format_report(self.tables, snap, timeout_s=self.timeout_s, iterations=iterations, exited=exited)


class GpuExecutor:
    """Runs ``tables`` as one persistent kernel on the current CUDA device, with the tables'
    placement: ``tables.num_workers`` worker CTAs, each running its queue of AOT tasks, and
    ``tables.scheduler_ctas`` CTAs of scheduler warps (mpk/compiler/place.py decides them; to
    run another placement, compile or re-place the tables with
    ``mpk.compiler.place.place_tables``). ``profile``: record per-task spans; ``timeout_s``:
    watchdog limit; ``debug``: build with bounded spins (a hang traps instead of spinning
    forever); ``local_jit``: an event whose only task is a JIT task hands it to the worker that
    fired it rather than to a scheduler (default; False sends every JIT task through the
    schedulers).
    """

    def __init__(self, tables: Tables, profile: bool = False, profile_capacity: int = 1 << 16,
                 timeout_s: float = 30.0, debug: bool = False, arch: str | None = None,
                 validate_tables: bool = True, tile_kernel: bool = False, local_jit: bool = True):
        if not torch.cuda.is_available():
            raise ExecutorUnavailableError("the gpu executor needs a CUDA device; use executor='cpu'")
        if validate_tables:
            validate(tables)
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise MpkError(f"timeout_s={timeout_s!r}; expected a finite number of seconds > 0")
        if profile and not (isinstance(profile_capacity, int) and profile_capacity > 0):
            raise MpkError(f"profile_capacity={profile_capacity!r}; expected an integer > 0 (records per worker)")
        self.t, self.timeout_s, self.device = tables, timeout_s, torch.device("cuda", torch.cuda.current_device())
        self.local_jit = local_jit
        self._context = torch.empty(1, device=self.device)  # the driver calls below need a current context
        props = torch.cuda.get_device_properties(self.device)
        check_device_fits(tables, props.multi_processor_count, f"{props.name} (cuda:{self.device.index})")
        self.layout = HostLayout(tables, local_jit)
        if arch is None:
            major, minor = props.major, props.minor
            arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
        self.cubin_path = build_cubin(generate(tables), arch, debug, tile_kernel)
        self.module = drv.Module(Path(self.cubin_path).read_bytes())
        self.kernel = self.module.function("mpk_persistent_kernel")
        self.tile_kernel = self.module.function("mpk_tile_kernel") if tile_kernel else None
        self.smem = dynamic_smem_bytes(tables)
        for fn in (self.kernel, self.tile_kernel):
            if fn is not None and self.smem:
                drv.allow_dynamic_smem(fn, self.smem)
        if drv.max_blocks_per_sm(self.kernel, THREADS, self.smem) < 1:
            raise MpkError(f"the persistent kernel cannot fit one CTA per SM (registers/shared memory; "
                           f"{self.smem} bytes of dynamic shared memory)")
        self.num_workers, self.scheduler_ctas = tables.num_workers, tables.scheduler_ctas
        self.grid = self.num_workers + self.scheduler_ctas
        self.num_schedulers = self.layout.num_schedulers
        self._setup(profile, profile_capacity)
        _LIVE.add(self)

    # --- device state ---------------------------------------------------------------------
    def _setup(self, profile: bool, profile_capacity: int) -> None:
        t, dev, lay = self.t, self.device, self.layout
        n_events = len(t.events)
        self.any_jit = lay.any_jit
        W, S = self.num_workers, self.num_schedulers
        i64 = dict(dtype=torch.int64, device=dev)
        self.d_tasks = _dev(t.tasks, dev)
        self.events = lay.events  # with the flags the host sets (types.cuh: EventDesc)
        self.d_events = _dev(lay.events, dev)
        self.d_aot_offsets = torch.from_numpy(lay.aot_offsets).to(dev)
        self.num_jit_events, self.start_jit_index = lay.num_jit_events, lay.start_jit_index
        self.d_task_infos = torch.from_numpy(lay.task_infos).to(dev)
        self.d_aot_entries = torch.from_numpy(lay.aot_entries).to(dev)
        self.d_jit_events = torch.from_numpy(lay.jit_events).to(dev)
        # Everything reset before each launch lives in one zeroed block.
        self.active_schedulers = lay.active_schedulers
        self.jit_capacity = lay.jit_capacity
        self._zero_layout = {"counters": n_events, "mailbox": self.active_schedulers * max(1, self.num_jit_events),
                             "jit_seq": W * self.jit_capacity, "jit_head": 16 * W, "done": 1, "profile_count": W}
        self.d_zero = torch.zeros(sum(self._zero_layout.values()), **i64)
        self.zero_ptr, pos = {}, 0
        for name, n in self._zero_layout.items():
            self.zero_ptr[name] = self.d_zero.data_ptr() + 8 * pos
            pos += n
        # The block's state at launch: iteration 1 starts at once, and its JIT tasks are
        # announced to every scheduler. One device copy restores it (no kernel but ours).
        reset = torch.zeros_like(self.d_zero)
        reset[self._offset("counters") + t.start_event] = 1
        if self.start_jit_index >= 0:
            base, J = self._offset("mailbox"), self.num_jit_events
            reset[base + self.start_jit_index: base + self.active_schedulers * J: J] = 1
        self.d_reset = reset
        self._bound_ptrs: list[int] | None = None
        self.d_jit_values = torch.zeros(W * self.jit_capacity * 12, dtype=torch.int32, device=dev)  # TaskInfo
        # host-mapped status words and abort flag: readable and writable while the kernel runs
        self.h_status = drv.MappedHostBuffer((W + S) * STATUS_WORDS)
        self.h_abort = drv.MappedHostBuffer(1)
        # host-mapped record of the first bad input value a launch's tasks found (BadInputRecord,
        # 40 bytes); the module's pointer to it is written once
        self.h_bad_input = drv.MappedHostBuffer(10)
        self.epoch = self.checked_epoch = 0  # launches so far; the latest whose report was raised
        # per worker, the task it last started, (epoch << 32) | task: not reset (the epoch says whose)
        self.d_running = torch.zeros(W, **i64)
        ptr = torch.tensor([self.h_bad_input.device_ptr], dtype=torch.int64, device=dev)
        drv.copy_device_async(self.module.global_ptr("mpk_bad_input")[0], ptr.data_ptr(), 8,
                              torch.cuda.current_stream(dev).cuda_stream)
        torch.cuda.synchronize(dev)
        self.profile_capacity = profile_capacity if profile else 0
        self.d_profile = torch.zeros(W * max(1, self.profile_capacity) * PROFILE_WORDS, **i64) if profile else None
        # buffers: intermediates allocated once; inputs bound per run
        self.buf_shape, self.buf_dtype = buffer_layouts(t)
        self.buffers: list[torch.Tensor | None] = [
            None if b["role"] == ROLE_INPUT else torch.empty(self.buf_shape[i], dtype=self.buf_dtype[i], device=dev)
            for i, b in enumerate(t.buffers)]
        self.d_buffer_ptrs = torch.zeros(max(1, len(t.buffers)), **i64)
        self.aligned = aligned_inputs(t)
        self._last_done: torch.cuda.Event | None = None
        # (buffer, argument index) of each graph input; a decode loop passes the same tensors
        # every step, so a launch whose arguments match the last full bind's keys skips it
        self._input_plan = [(b, int(t.buffers[b]["input_index"]))
                            for b in np.nonzero(t.buffers["role"] == ROLE_INPUT)[0].tolist()]
        # The executor holds no argument beyond its launch (a decode loop's KV cache is GBs, and
        # the compiled step outlives the loop): of the last bound arguments only their keys, and
        # an argument that an output passes through (a cache written in place) only from its bind
        # until outputs() has viewed it. The launch reads them in stream order, as any op does.
        self._bound_keys: list[list[Any]] | None = None  # None: the next launch binds in full
        self._input_ptrs: dict[int, int] = {}  # buffer -> the bound argument's address
        # contiguous copies of strided arguments, which the buffer table points at: held until
        # the next bind, when the launch that reads them is on the stream (freed earlier, their
        # memory could go to another tensor before the kernel reads it; a strided argument costs
        # its size in device memory until then)
        self._copies: list[torch.Tensor] = []
        outputs_of = {int(self.t.views[o["view"]]["buffer"]) for o in t.meta["outputs"] if "value" not in o}
        self._passthrough = [(b, i) for b, i in self._input_plan if b in outputs_of]
        # each output: its constant value, or (buffer, shape, strides, offset, an input's?) of its view
        self._output_plan: list[tuple[Any, ...]] = []
        for o in t.meta["outputs"]:
            if "value" in o:
                self._output_plan.append((o["value"],))
                continue
            v = t.views[o["view"]]
            nd, b = int(v["ndim"]), int(v["buffer"])
            self._output_plan.append((b, [int(x) for x in v["shape"][:nd]], [int(x) for x in v["strides"][:nd]],
                                      int(v["offset"]), t.buffers[b]["role"] == ROLE_INPUT))
        self.args = self._make_args()  # passed by value at launch (a __grid_constant__ parameter)
        self._launch_params = drv.param_array([self.args])
        self.probe = _GpuProbe(self)
        self._watchdog = Watchdog(self.timeout_s, self.probe)

    def _make_args(self) -> _Args:
        """The kernel's arguments, built once: a launch sets only ``iterations`` and ``epoch``
        (the struct is copied into the launch's parameter bank when the launch is issued)."""
        z = self.zero_ptr
        return _Args(
            tasks=self.d_tasks.data_ptr(), events=self.d_events.data_ptr(), counters=z["counters"],
            aot_offsets=self.d_aot_offsets.data_ptr(), aot_entries=self.d_aot_entries.data_ptr(),
            task_infos=self.d_task_infos.data_ptr(), jit_events=self.d_jit_events.data_ptr(), mailbox=z["mailbox"],
            jit_values=self.d_jit_values.data_ptr(), jit_seq=z["jit_seq"], jit_head=z["jit_head"], done=z["done"],
            status=self.h_status.device_ptr, abort_flag=self.h_abort.device_ptr,
            profile=self.d_profile.data_ptr() if self.d_profile is not None else None,
            profile_count=z["profile_count"], running=self.d_running.data_ptr(), profile_capacity=self.profile_capacity,
            num_workers=self.num_workers, num_schedulers=self.num_schedulers,
            active_schedulers=self.active_schedulers, num_tasks=len(self.t.tasks), num_events=len(self.t.events),
            num_jit_events=self.num_jit_events, start_jit_index=self.start_jit_index,
            start_event=self.t.start_event, end_event=self.t.end_event, iterations=1,
            any_jit=int(self.any_jit), jit_capacity=self.jit_capacity, epoch=self.epoch)

    def _bind(self, args: Sequence[torch.Tensor]) -> None:
        if len(args) != len(self._input_plan):
            raise ValueError(f"the compiled graph takes {len(self._input_plan)} tensor arguments, got {len(args)}")
        if self._unmoved(args):
            # the addresses, shapes, strides and dtypes bound last time: checked then, in the table now
            for b, i in self._passthrough:
                self.buffers[b] = args[i]
            return
        copies, bound = [], {}
        for b, i in self._input_plan:
            a = args[i]
            check_argument(self.t, b, a, self.buf_shape[b], self.buf_dtype[b])
            if a.device != self.device:
                raise ValueError(f"argument {i} is on {a.device}; the kernel runs on {self.device}")
            c = a if a.is_contiguous() else a.detach().contiguous()
            if c is not a:
                copies.append(c)
            if b in self.aligned and c.data_ptr() % 16:
                raise ValueError(f"argument {i} ({self.t.meta['buffers'][b]['name']}) starts at an address that is not "
                                 "16-byte aligned, which its tasks' vector loads need; pass a fresh tensor "
                                 "(e.g. .clone()) instead of an offset view")
            bound[b] = c
        # all checked: nothing of a refused call is bound
        self._input_ptrs = {b: c.data_ptr() for b, c in bound.items()}
        self._copies = copies
        for b, _ in self._passthrough:
            self.buffers[b] = bound[b]
        # a strided argument was copied: the next launch must copy it again (its values may change)
        self._bound_keys = None if copies else [list(map(key, args)) for key in _KEYS]
        ptrs = [self._input_ptrs.get(b, 0) if buf is None else buf.data_ptr() for b, buf in enumerate(self.buffers)]
        if ptrs == self._bound_ptrs:  # the module's table still holds them
            return
        self._bound_ptrs = ptrs
        self.d_buffer_ptrs[: len(ptrs)].copy_(torch.tensor(ptrs, dtype=torch.int64))
        # into the module's buffer table (constant bank), ordered on the stream before the launch
        dst, nbytes = self.module.global_ptr("mpk_buffers")
        drv.copy_device_async(dst, self.d_buffer_ptrs.data_ptr(), min(nbytes, 8 * len(ptrs)),
                              torch.cuda.current_stream(self.device).cuda_stream)

    def _unmoved(self, args: Sequence[torch.Tensor]) -> bool:
        """Whether every argument has the address, shape, strides and dtype its predecessor
        had at the last full bind (the device follows from the address: one address space). All
        are compared, not the tensors' identity: a tensor changed in place keeps it (``t_()``,
        ``.data =``), and torch.compile's guards need not see that (torch 2.11 does not guard
        a parameter's strides). False before a full bind, or after one that copied."""
        if self._bound_keys is None:
            return False
        try:
            return all(list(map(key, args)) == bound for key, bound in zip(_KEYS, self._bound_keys))
        except (TypeError, AttributeError):  # not a tensor: the full bind says which
            return False

    # --- running ------------------------------------------------------------------------------
    def launch(self, args: Sequence[torch.Tensor], iterations: int = 1) -> torch.cuda.Event:
        """Bind, reset and launch asynchronously on the executor's device's current stream
        (whichever device is current on the calling thread); returns a done-event."""
        if torch.cuda.current_device() == self.device.index:
            return self._launch(args, iterations)
        with torch.cuda.device(self.device):  # the driver calls act on the thread's current context
            return self._launch(args, iterations)

    def _launch(self, args: Sequence[torch.Tensor], iterations: int) -> torch.cuda.Event:
        if not isinstance(iterations, int) or not 1 <= iterations < 2 ** 31:
            raise ValueError(f"iterations={iterations!r}; expected an integer in [1, 2^31)")
        self._watchdog.check()  # an earlier launch not waited on hung
        self.check_inputs()  # a report of an earlier launch not waited on
        if _DROPPED:
            _release_dropped()
        stream = torch.cuda.current_stream(self.device.index)
        # a launch still in flight on another stream shares our state: the buffer table below
        # is rewritten only after it (and the copies of its outputs) are done
        if self._last_done is not None:
            stream.wait_event(self._last_done)
        self._bind(args)
        self.epoch += 1
        self.args.iterations, self.args.epoch = iterations, self.epoch
        drv.copy_device_async(self.d_zero.data_ptr(), self.d_reset.data_ptr(), 8 * self.d_zero.numel(),
                              stream.cuda_stream)
        # h_status is not reset here: a launch still running owns it until it ends (its watchdog
        # report reads it), and every launch leaves each row exited or aborted, which the report
        # counts as neither waiting nor idle, as it does a row a new launch has not written yet
        drv.launch(self.kernel, self.grid, THREADS, stream.cuda_stream, self._launch_params, cooperative=True,
                   smem=self.smem)
        done = torch.cuda.Event()
        done.record(stream)
        self._last_done = done
        done.mpk_epoch = self.epoch  # the launch the watchdog stops if this one hangs
        self._watchdog.watch(self.epoch, _query(done, self.device.index), (self.epoch, iterations))
        return done

    def _offset(self, name: str) -> int:
        return (self.zero_ptr[name] - self.d_zero.data_ptr()) // 8

    def run(self, args: Sequence[torch.Tensor], iterations: int = 1, wait: bool = True) -> list[Any]:
        """Run ``iterations`` iterations in one launch; returns the outputs. ``wait``: block
        under the watchdog until the launch ends; else return at once (outputs are ordered on
        the current stream, like any CUDA op's)."""
        done = self.launch(args, iterations)
        if wait:
            self.wait(done, iterations)
        return self.outputs()

    def wait(self, done: torch.cuda.Event, iterations: int = 1) -> None:
        """Block until the launch of ``done`` ends; ``WatchdogTimeout`` if the watchdog stopped
        it (or an earlier launch). ``iterations`` is unused (the launch recorded its own)."""
        self._watchdog.wait(getattr(done, "mpk_epoch", self.epoch), done.query)
        torch.cuda.synchronize(self.device)  # surfaces any device-side fault of the launch
        self.check_inputs()

    def check_inputs(self) -> None:
        """Raise ``BadInputError`` if a launch since the last check found a graph input it could
        not take (``wait`` and ``launch`` call it; the report of a launch still running arrives
        when it ends)."""
        rec = self.h_bad_input.array
        epoch = int(rec[0])
        if epoch <= self.checked_epoch:
            return
        self.checked_epoch = epoch
        code, out_buffer = int(rec[1]), int(rec[2])
        row, value, limit = (int(x) for x in rec.view(np.int64)[2:5])
        ops = [i for i, o in enumerate(self.t.ops) if int(o["output"]) == out_buffer]
        op = f"op {self.t.meta['ops'][ops[0]]['name']!r} ({self.t.meta['ops'][ops[0]]['kind']})" if ops else "an op"
        latest = "" if epoch == self.epoch else f" (launch {epoch} of {self.epoch} so far)"
        raise BadInputError(f"{op}{latest}: {bad_input_message(code, value, row, limit)}; "
                            f"the launch skipped it, and its outputs are not valid")

    def outputs(self) -> list[Any]:
        self._watchdog.check()  # a launch that hung has no outputs to hand out
        out = []
        for plan in self._output_plan:
            if len(plan) == 1:  # a constant
                out.append(plan[0])
                continue
            b, shape, strides, offset, is_input = plan
            buf = self.buffers[b]
            if buf is None:
                raise MpkError("outputs() passes an argument through, which the executor holds only until the "
                               "first outputs() after a launch: take the outputs once per launch")
            view = view_of(buf, shape, strides, offset)  # bound buffers are contiguous
            # intermediates are reused by the next launch: hand out copies (inputs pass through)
            out.append(view if is_input else view.clone())
        for b, _ in self._passthrough:  # the caller holds what it passed in; the executor lets go
            self.buffers[b] = None
        if self._last_done is not None:
            # the next launch, on whichever stream, waits for these copies too, not just the kernel
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device.index))
            done.mpk_epoch = self._last_done.mpk_epoch
            self._last_done = done
        return out

    def run_tile_kernel(self, op: int, args: Sequence[torch.Tensor]) -> None:
        """Test wrapper: every tile of op ``op`` alone, one CTA per tile (inputs must be bound;
        construct with ``tile_kernel=True``)."""
        if self.tile_kernel is None:
            raise MpkError("this executor was built without the tile kernel: pass tile_kernel=True")
        with torch.cuda.device(self.device):
            self._run_tile_kernel(op, args)

    def _run_tile_kernel(self, op: int, args: Sequence[torch.Tensor]) -> None:
        self._watchdog.check()
        self.check_inputs()
        stream = torch.cuda.current_stream(self.device)
        if self._last_done is not None:  # a launch still running reads the buffer table _bind rewrites
            stream.wait_event(self._last_done)
        self._bind(args)
        self.epoch += 1
        n_tiles = int(self.t.ops[op]["num_tiles"])
        drv.launch(self.tile_kernel, n_tiles, THREADS, stream.cuda_stream, [ctypes.c_int(op), ctypes.c_int(self.epoch)],
                   smem=self.smem)
        torch.cuda.synchronize(self.device)
        self.check_inputs()

    def __del__(self):
        # an asynchronous launch may still run: what it uses outlives this object until it ends
        done = getattr(self, "_last_done", None)
        if done is not None and not sys.is_finalizing() and not done.query():
            _DROPPED.append((done, list(vars(self).values())))

    def _describe(self, task: int) -> str:
        op = int(self.t.tasks[task]["op"])
        if op < 0:
            return "dummy"
        return f"op {self.t.meta['ops'][op]['name']!r} tile {int(self.t.tasks[task]['tile'])}"

    # --- profiler --------------------------------------------------------------------------
    def trace(self, path: str | Path | None = None) -> dict:
        """Chrome/Perfetto trace of the last profiled launch: one track per SM. A task's span
        runs from its inputs being ready (a gated task: its gate opening) to its closing
        barrier; its category is the op's kind (``dummy`` for a dummy task) and its args name
        the op (``mpk.executors.timeline`` sums and draws them). A kernel built with
        ``-DMPK_HOP_STAMPS`` also stamps each task's way from its worker's previous task: its
        args then say when the worker had it in hand (``ready``) and, for a gated task, when it
        reached its gate (``gate``), on the trace's µs clock (dummy tasks, which thread 0
        completes in passing, have neither)."""
        if self.d_profile is None:
            raise MpkError("profiling is off: construct GpuExecutor(..., profile=True)")
        counts = self.d_zero[self._offset("profile_count"): self._offset("profile_count") + self.num_workers].cpu()
        recs = self.d_profile.view(self.num_workers, self.profile_capacity, PROFILE_WORDS).cpu().numpy()
        events, t0 = [], None
        for w in range(self.num_workers):
            for rec in recs[w, : int(counts[w])]:
                first = int(rec[3]) or int(rec[1])  # ready, where stamped, comes before a gated task's start
                t0 = first if t0 is None else min(t0, first)
        for w in range(self.num_workers):
            for task_sm, start, end, ready, gate in recs[w, : int(counts[w])]:
                task, sm = int(task_sm) & 0xFFFFFFFF, int(task_sm) >> 32
                args = {"task": task, "worker": w}
                op = int(self.t.tasks[task]["op"])
                meta = self.t.meta["ops"][op] if op >= 0 else None
                kind = op_form(meta["kind"], meta.get("attrs", {})) if meta else "dummy"  # a timeline tells the forms apart
                if op >= 0:
                    args["op"] = self.t.meta["ops"][op]["name"]
                args.update({k: (int(v) - t0) / 1e3 for k, v in (("ready", ready), ("gate", gate)) if v})
                events.append({"name": self._describe(task), "cat": kind, "ph": "X", "pid": 0, "tid": sm,
                               "ts": (int(start) - t0) / 1e3, "dur": max(0.0, (int(end) - int(start)) / 1e3),
                               "args": args})
        doc = {"traceEvents": events, "displayTimeUnit": "ns"}
        if path is not None:
            Path(path).write_text(json.dumps(doc))
        return doc
