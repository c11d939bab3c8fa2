"""Options of ``torch.compile(model, backend="mpk", options={...})``, parsed and checked."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

from mpk.compiler.place import DEFAULT_SCHEDULER_CTAS, check_counts
from mpk.errors import OptionError

EXECUTORS = ("gpu", "cpu")
FALLBACKS = ("error", "eager")
DEFAULT_SCHEDULER_SMS = DEFAULT_SCHEDULER_CTAS  # the SMs the default num_workers leaves to scheduler CTAs
# num_workers and scheduler_ctas for the cpu executor, which simulates the workers: the tables
# hold one int32 queue offset per worker and every op defaults to a wave of num_workers tasks, so
# a count far past any GPU's SMs (132 on an H100/H200) only grows the graph; the gpu executor
# takes at most the device's SMs (one CTA per SM)
MAX_CPU_CTAS = 1024

_warned_cpu_default = False


def device_sms() -> int | None:
    """The current CUDA device's SM count, or None without CUDA."""
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else None


def default_num_workers(scheduler_ctas: int | None = None) -> int:
    """One worker per SM not taken by scheduler CTAs (``scheduler_ctas``, or 4 when None); 128
    without CUDA."""
    reserved = DEFAULT_SCHEDULER_SMS if scheduler_ctas is None else scheduler_ctas
    sms = device_sms()
    return 128 if sms is None else max(1, sms - reserved)


@dataclass(frozen=True)
class CompileOptions:
    """
    executor     "gpu" (persistent kernel) | "cpu" (reference interpreter). Default: gpu when
                 CUDA is available, else cpu with a one-time warning.
    partition    {op name or op kind: tiles per output dim (list) or {dim: tiles}}; the kind
                 "matmul" covers every fused projection form, an op name picks one op.
    fallback     "error" (default): unsupported ops raise; "eager": they run in PyTorch.
    fuse_norm_prologue  compute an RMSNorm inside the projection that consumes it (the matmul
                 reads x, normalizes its rows on chip and multiplies; also the gate·up
                 projection with its SiLU·mul epilogue; default True) when its input fits a
                 task's on-chip tile (mpk.ops.linalg.NORM_TILE_BYTES: a decode step at batch
                 1, or 2 for hidden ≤ 2048); larger inputs keep the separate norm task, since
                 each projection task of the fused form normalizes the whole input itself.
    fuse_norm_stats  split an RMSNorm whose input is a residual projection's output between
                 that projection (its epilogue also writes h·g and sums of h² over groups of 16
                 or 8 columns, mpk.ops.linalg.stats_group) and the projection after the norm
                 (its prologue scales those sums by each row's rstd), so no norm stage runs
                 between them. "auto" (default): the norms of more than 4 KiB of activations
                 (mpk.ops.linalg.NORM_SPLIT_MIN_BYTES: a bf16 decode step from batch 2 for
                 hidden 2048, from batch 1 for 4096), smaller ones left to the norm prologue,
                 which is cheaper for them; every one with fuse_norm_prologue off.
                 True: every such norm, the prologue only for the first layer's; False: none.
    fuse_rope_attention  run a decode layer's qk-norm + RoPE + KV append inside its paged
                 attention tasks (default True), one op boundary fewer.
    debug_dir    directory to dump the OpGraph, tables, summary, DOT and JSON of each graph.
    num_workers  worker CTAs of the launch: the compiler sizes the default partitioning for
                 them (one wave of tasks per op; one exception: mpk/compiler/partition.py) and
                 places every AOT task on one of them (mpk/compiler/place.py); the tables
                 carry that placement to both executors. Default (None): the launch fills the
                 device — every SM not taken by scheduler CTAs is a worker (a graph without
                 JIT tasks has none, so every SM) — while partitioning targets SMs − 4 either
                 way (128 without CUDA, for both). The gpu executor refuses tables whose
                 num_workers + scheduler_ctas exceed the device's SMs.
    scheduler_ctas  CTAs of scheduler warps (4 each) that hand out JIT tasks; None (default):
                 4 when the graph has JIT tasks, else 0. A graph with JIT tasks needs >= 1.
                 At most the device's SMs with executor "gpu" (num_workers + scheduler_ctas
                 when both are given), at most MAX_CPU_CTAS (1024) each with "cpu".
    seed         schedule seed of the cpu executor (which legal order it picks).
    check_races  cpu executor: track every element read/written (default True).
    verify       gpu executor: run the compiler's happens-before check (mpk.compiler.verify)
                 on the tables before building the kernel (default False; compiles for the
                 cpu executor always run it).
    timeout_s    gpu executor: watchdog limit per launch in seconds (default 30).
    sync         gpu executor: wait for each launch (default True); False returns at once with
                 outputs ordered on the current stream (decode loops and benchmarks: the host
                 prepares step k+1 while step k runs). Either way the watchdog aborts a launch
                 that outlives timeout_s and the next call raises its report.
    profile_dir  gpu executor: write a Chrome/Perfetto trace of each launch there.
    tensor_parallel  (rank, world): compile rank ``rank``'s share of a DecoderLM step split over
                 ``world`` ranks (mpk.distributed.shard; the norm_stats split is off then).
                 None (default): no sharding. World 1 still inserts the collectives, so one
                 rank runs the communication path. The runner binds weight shards made once
                 from the full weights (mpk.distributed.binding) and takes communication buffers
                 from the process's SymmetricAllocator (mpk.distributed.symmetric).
    comm_tiles   column tiles of each collective under tensor_parallel (None, default:
                 mpk.distributed.shard.default_comm_tiles). Tile t is sent once the producer's tiles covering it are
                 written, so early tiles' transfers overlap later tiles' matmuls; 1 serialises
                 each collective behind its whole producer (the no-overlap baseline).
    split_k      K slices of split-K decode projections (mpk.compiler.splitk): a plain
                 projection of ≤ 16 rows whose input an op produces piecewise along K (the
                 o-projection over attention heads, the down-projection over the gate·up
                 projection's columns) becomes S partial-product tasks per column tile, each
                 reading only its K slice (so it waits only for the producer tiles of that
                 slice) and writing its own fp32 plane, and one finish task per column tile
                 that adds the planes in slice order, adds the residual and rounds once
                 (deterministic). S is capped at K / granule (whole heads, multiples of 32).
                 None, 0 or 1 (default): off. The CUDA tasks are general (one thread per
                 output), not bandwidth-grade: for the CPU interpreter and GPU correctness.
    pipelining   True (default): a task waits only for the producer tiles it reads, so it
                 overlaps the rest of the ops before it (cross-task pipelining). False, an
                 ablation: every task waits for all tasks of each op it reads from, as
                 op-by-op kernels would (mpk.compiler.depend.whole_ops).
    """

    executor: str = "cpu"
    partition: dict[str, Any] = field(default_factory=dict)
    fallback: str = "error"
    fuse_norm_prologue: bool = True
    fuse_norm_stats: bool | Literal["auto"] = "auto"
    fuse_rope_attention: bool = True
    debug_dir: str | None = None
    num_workers: int | None = None
    scheduler_ctas: int | None = None
    seed: int = 0
    check_races: bool = True
    verify: bool = False
    timeout_s: float = 30.0
    sync: bool = True
    profile_dir: str | None = None
    tensor_parallel: tuple[int, int] | None = None
    comm_tiles: int | None = None
    split_k: int | None = None
    pipelining: bool = True

    @property
    def partition_workers(self) -> int:
        """The worker count the default partitioning (and the frontend's op choices) target."""
        return self.num_workers if self.num_workers is not None else default_num_workers(self.scheduler_ctas)

    @property
    def fill_sms(self) -> int | None:
        """With num_workers left to its default on a CUDA machine, the SMs the launch fills."""
        return device_sms() if self.num_workers is None else None

    def optional_fusions(self) -> tuple[str, ...]:
        """The optional pattern fusions (mpk.frontend.patterns.OPTIONAL_MATCHERS) these options
        ask for, in the order they apply. Under tensor_parallel no norm_stats split: its row
        sums need the whole product a row-parallel projection only has after its all_reduce."""
        if self.fuse_norm_stats is False or self.tensor_parallel is not None:
            split = ()
        elif self.fuse_norm_stats == "auto" and self.fuse_norm_prologue:  # small norms: the prologue's
            split = ("norm_stats_large",)
        else:
            split = ("norm_stats",)
        return split + (("norm_prologue",) if self.fuse_norm_prologue else ())

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> "CompileOptions":
        global _warned_cpu_default
        if options is not None and not isinstance(options, Mapping):
            raise OptionError(f"options={options!r}; expected a dict of option names to values, e.g. "
                              "{'executor': 'cpu', 'num_workers': 8}")
        opts = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted((k for k in opts if k not in known), key=repr)
        if unknown:
            raise OptionError(f"unknown mpk option(s) {unknown}; valid options: {sorted(known)}")
        if "executor" not in opts:
            if torch.cuda.is_available():
                opts["executor"] = "gpu"
            else:
                opts["executor"] = "cpu"
                if not _warned_cpu_default:
                    warnings.warn("mpk: CUDA is not available; running compiled graphs on the CPU reference "
                                  "interpreter (options={'executor': 'cpu'} silences this)", stacklevel=3)
                    _warned_cpu_default = True
        # (isinstance first: `in` compares with ==, which an array answers elementwise)
        if not isinstance(opts["executor"], str) or opts["executor"] not in EXECUTORS:
            raise OptionError(f"executor={opts['executor']!r}; expected one of {EXECUTORS}")
        if not isinstance(opts.get("fallback", "error"), str) or opts.get("fallback", "error") not in FALLBACKS:
            raise OptionError(f"fallback={opts['fallback']!r}; expected one of {FALLBACKS}")
        n = opts.get("num_workers")
        check_counts(1 if n is None else n, opts.get("scheduler_ctas"))
        _check_cta_bounds(opts["executor"], n, opts.get("scheduler_ctas"))
        for flag in ("sync", "fuse_norm_prologue", "fuse_rope_attention", "check_races", "verify", "pipelining"):
            if not isinstance(opts.get(flag, False), bool):
                raise OptionError(f"{flag}={opts[flag]!r}; expected True or False")
        t = opts.get("timeout_s", 30.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise OptionError(f"timeout_s={t!r}; expected a finite number of seconds > 0")
        seed = opts.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise OptionError(f"seed={seed!r}; expected an int")
        for path in ("debug_dir", "profile_dir"):
            if not isinstance(opts.get(path), (str, os.PathLike, type(None))):
                raise OptionError(f"{path}={opts[path]!r}; expected a directory path (str or os.PathLike) or None")
            try:
                name = None if opts.get(path) is None else os.fspath(opts[path])
                if isinstance(name, str) and "\0" in name:  # os.path.exists says False; makedirs would raise
                    raise ValueError("embedded null character")
                is_file = name is not None and os.path.exists(name) and not os.path.isdir(name)
            except (TypeError, ValueError) as e:  # a NUL in the name, a __fspath__ returning no path
                raise OptionError(f"{path}={opts[path]!r} is not a usable path ({e}); expected a directory path") from None
            if is_file:
                raise OptionError(f"{path}={os.fspath(opts[path])!r} is a file; expected a directory (made if absent)")
        stats = opts.get("fuse_norm_stats", "auto")
        if not (isinstance(stats, bool) or (isinstance(stats, str) and stats == "auto")):
            raise OptionError(f"fuse_norm_stats={stats!r}; expected True, False or 'auto'")
        if opts.get("tensor_parallel") is not None:
            opts["tensor_parallel"] = _check_tensor_parallel(opts["tensor_parallel"])
        tiles = opts.get("comm_tiles")
        if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1):
            raise OptionError(f"comm_tiles={tiles!r}; expected None or an int ≥ 1 (1: no overlap)")
        slices = opts.get("split_k")
        if slices is not None and (not isinstance(slices, int) or isinstance(slices, bool) or slices < 0):
            raise OptionError(f"split_k={slices!r}; expected None or an int ≥ 0 (K slices of a split-K projection; "
                              "0 or 1: off)")
        part = opts.get("partition", {})
        if not isinstance(part, Mapping):
            raise OptionError(f"partition={part!r}; expected a dict mapping op name or kind to tile counts")
        for name, spec in part.items():
            _check_partition_spec(name, spec)
        opts["partition"] = dict(part)
        return cls(**opts)


def _check_tensor_parallel(tp: object) -> tuple[int, int]:
    """(rank, world) of a tensor_parallel option, or OptionError naming what is wrong."""
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(tp, (tuple, list)) or len(tp) != 2 or not all(is_int(v) for v in tp):
        raise OptionError(f"tensor_parallel={tp!r}; expected None or (rank, world), two ints")
    rank, world = tp
    if world < 1 or not 0 <= rank < world:
        raise OptionError(f"tensor_parallel=({rank}, {world}); expected world ≥ 1 and 0 ≤ rank < world")
    return rank, world


def _check_cta_bounds(executor: str, num_workers: int | None, scheduler_ctas: int | None) -> None:
    """OptionError unless the counts fit the launch: the device's SMs for the gpu executor
    (when CUDA is here to say how many), MAX_CPU_CTAS for the cpu executor."""
    sms = device_sms() if executor == "gpu" else None
    limit, what = (sms, f"the device's {sms} SMs (one CTA each)") if sms else \
        (MAX_CPU_CTAS, f"mpk.options.MAX_CPU_CTAS ({MAX_CPU_CTAS}) with the {executor} executor")
    for name, v in (("num_workers", num_workers), ("scheduler_ctas", scheduler_ctas)):
        if v is not None and v > limit:
            raise OptionError(f"{name}={v}; expected at most {what}")
    if sms and num_workers is not None and scheduler_ctas is not None and num_workers + scheduler_ctas > sms:
        raise OptionError(f"num_workers={num_workers} + scheduler_ctas={scheduler_ctas} is more than {what}; "
                          f"expected a sum of at most {sms}")


def _check_partition_spec(name: object, spec: object) -> None:
    """OptionError unless a partition entry is an op name or kind mapped to tile counts: a list
    of positive ints (one per output dim) or a dict of dims (ints, or digit strings as JSON
    writes them) to positive ints. The compiler bounds each count by its dim's size."""
    if not isinstance(name, str):
        raise OptionError(f"partition key {name!r}; expected an op name or op kind (a str)")

    def count(n: object) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    def dim(d: object) -> bool:
        return (isinstance(d, int) and not isinstance(d, bool)) or (isinstance(d, str) and d.lstrip("-").isdigit())

    if isinstance(spec, Mapping):
        ok = all(dim(d) and count(n) for d, n in spec.items())
    else:
        ok = isinstance(spec, (list, tuple)) and all(count(n) for n in spec)
    if not ok:
        raise OptionError(f"partition[{name!r}]={spec!r}; expected a list of tile counts (ints >= 1), one per "
                          "output dim, or a dict dim -> tile count")
