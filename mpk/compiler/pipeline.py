"""OpGraph → tables: steps 1–7 in order (7a, placement, just before 7), each a function over the
task-graph IR, timed; step 0, the split-K rewrite of the OpGraph, with the ``split_k`` option."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from mpk.compiler.depend import depend, whole_ops
from mpk.compiler.fuse import fuse
from mpk.compiler.linearize import linearize
from mpk.compiler.modes import assign_modes
from mpk.compiler.normalize import normalize
from mpk.compiler.partition import PartitionSpec, decompose
from mpk.compiler.place import place
from mpk.compiler.prune import prune
from mpk.compiler.splitk import split_gemms
from mpk.compiler.splitk import split_k as split_k_pass
from mpk.compiler.tables import Tables, emit
from mpk.compiler.taskgraph import DUMMY, TaskGraph
from mpk.compiler.verify import VerifyReport, verify
from mpk.ir.opgraph import OpGraph


@dataclass
class CompileStats:
    """What the inspection report prints."""

    tasks_per_op: dict[str, int]
    partitions: dict[str, tuple[int, ...]]
    num_tasks: int
    num_dummy_tasks: int
    num_edges: int
    num_pruned_edges: int
    events_before_fusion: int
    events_after_fusion: int
    events_after_normalization: int
    num_jit_tasks: int
    num_aot_tasks: int
    num_barriers: int
    seconds: dict[str, float] = field(default_factory=dict)
    placement: dict[str, int] = field(default_factory=dict)  # the tables' meta["placement"]
    verified: VerifyReport | None = None  # the happens-before check's result, when it ran

    @property
    def dummy_share(self) -> float:
        return self.num_dummy_tasks / self.num_tasks if self.num_tasks else 0.0

    def summary(self) -> str:
        lines = [
            f"tasks: {self.num_tasks} ({self.num_tasks - self.num_dummy_tasks} compute, "
            f"{self.num_dummy_tasks} dummy = {100 * self.dummy_share:.1f}%)",
            f"dependency edges: {self.num_edges} ({self.num_pruned_edges} more were implied by other paths and pruned)",
            f"events: {self.events_before_fusion} before fusion (one per edge) -> "
            f"{self.events_after_fusion} after fusion -> {self.events_after_normalization} after normalization",
            f"launch modes: {self.num_jit_tasks} JIT, {self.num_aot_tasks} AOT; {self.num_barriers} global barriers",
            f"placement: {self.placement.get('num_workers')} workers, {self.placement.get('scheduler_ctas')} "
            f"scheduler CTAs ({self.placement.get('scheduler_warps')} scheduler warps)",
            "compile time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items()),
        ]
        if self.verified is not None:
            lines.append(self.verified.summary())
        lines += [
            "tasks per op:",
        ]
        for name, n in self.tasks_per_op.items():
            lines.append(f"  {name:32s} {n:6d}  grid {self.partitions[name]}")
        return "\n".join(lines)


@dataclass
class CompiledGraph:
    graph: OpGraph
    taskgraph: TaskGraph
    tables: Tables
    stats: CompileStats
    # the tensor-parallel sharding the graph came from (mpk.distributed.shard.ShardedGraph):
    # how its inputs derive from the caller's; None when unsharded
    sharded: Any = None


def compile_graph(graph: OpGraph, num_workers: int = 128,
                  partition: Mapping[str, PartitionSpec] | None = None,
                  options: Mapping[str, Any] | None = None, scheduler_ctas: int | None = None,
                  fill_sms: int | None = None, check: bool = False, split_k: int | None = None,
                  pipelining: bool = True) -> CompiledGraph:
    """Run compiler steps 1–7 on ``graph``; deterministic in its inputs. ``num_workers`` sizes
    the default partitioning and is the launch's worker count, unless ``fill_sms`` is given:
    then every one of those SMs not taken by scheduler CTAs is a worker; ``scheduler_ctas``
    (None: 4 when the graph has JIT tasks, else 0) the launch's scheduler CTAs
    (mpk.compiler.place). ``check`` runs the happens-before check (mpk.compiler.verify) on the
    tables, raising VerifyError; its report lands in ``stats.verified``. ``split_k`` ≥ 2 first
    splits the decode projections whose input is produced piecewise along K into that many
    accumulation slices (mpk.compiler.splitk); tensor-core GEMMs too small to fill the workers
    are always split so (split_gemms); the result's ``graph`` is then the rewritten one.
    ``pipelining=False`` makes every task wait for all tasks of each op it reads from
    (mpk.compiler.depend.whole_ops): the ablation baseline without cross-task overlap."""
    seconds: dict[str, float] = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        seconds[name] = time.perf_counter() - t0
        return out

    if split_k and split_k >= 2:
        graph = timed("split_k", split_k_pass, graph, split_k)
    graph = timed("split_gemms", split_gemms, graph, num_workers, partition)
    tg = timed("decompose", decompose, graph, num_workers, partition)
    timed("depend", depend, tg)
    if not pipelining:
        timed("whole_ops", whole_ops, tg)
    timed("prune", prune, tg)
    timed("fuse", fuse, tg)
    timed("normalize", normalize, tg)
    timed("linearize", linearize, tg)
    timed("modes", assign_modes, tg)
    timed("place", place, tg, num_workers, scheduler_ctas, fill_sms)
    shaping = dict(options or {}, num_workers=num_workers, scheduler_ctas=scheduler_ctas, fill_sms=fill_sms)
    if split_k and split_k >= 2:  # (recorded only when on: the default's tables keep their bytes)
        shaping["split_k"] = split_k
    if not pipelining:
        shaping["pipelining"] = False
    tables = timed("emit", emit, tg, shaping)
    verified = timed("verify", verify, tables) if check else None
    num_dummy = sum(1 for o in tg.task_op if o == DUMMY)
    jit = sum(tg.jit)
    stats = CompileStats(
        tasks_per_op={graph.ops[t.op_id].name: t.num_tasks for t in tg.tiles},
        partitions={graph.ops[t.op_id].name: t.grid for t in tg.tiles},
        num_tasks=tg.num_tasks, num_dummy_tasks=num_dummy, num_edges=tg.num_edges,
        num_pruned_edges=tg.num_pruned_edges,
        events_before_fusion=tg.events_before_fusion, events_after_fusion=tg.events_after_fusion,
        events_after_normalization=len(tg.events), num_jit_tasks=jit, num_aot_tasks=tg.num_tasks - jit,
        num_barriers=sum(tg.barrier), seconds=seconds, placement=dict(tables.meta["placement"]),
        verified=verified,
    )
    return CompiledGraph(graph, tg, tables, stats)
