"""The multi-rank CPU interpreter: N ranks' tables run together with put/signal semantics.

Each rank is an ordinary ``Interpreter`` (its own tables, workers, events and local race
checks) stepped one task at a time; the ranks share a ``CpuSymmetricHeap``, through which
``comm_put`` tiles write into peers' receive slots and signals. Which rank moves next is drawn
at random (seeded), and within a rank which ready task runs, so runs explore interleavings of
ranks and workers. A rank whose ready tasks all wait on signals (``OpDef.wait``) sits out until
another rank makes progress.

Failures are typed: ``DeadlockError`` when no rank can progress, naming each rank's waiting
tasks and the signals they wait for (a dropped signal, a cycle between ranks); ``RaceError``
from the heap when a put lands on a slot its owner has not consumed, or a reduce reads a slot
that does not hold the sequence it expects (mpk.distributed.symmetric), and from each rank's
interpreter for local races.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mpk.compiler import compile_graph
from mpk.distributed.binding import RankBinder
from mpk.distributed.shard import ShardedGraph, shard_graph
from mpk.distributed.symmetric import CpuSymmetricHeap
from mpk.errors import DeadlockError
from mpk.executors.interpreter import Interpreter
from mpk.ir.opgraph import OpGraph


@dataclass
class Rank:
    """One simulated rank: its sharded graph, interpreter and argument binder."""

    sharded: ShardedGraph
    interpreter: Interpreter
    binder: RankBinder


def build_ranks(graph: OpGraph, world: int, num_workers: int = 8, comm_tiles: int | None = None,
                heap: CpuSymmetricHeap | None = None) -> list[Rank]:
    """Shard ``graph`` for each of ``world`` ranks, compile each (with the happens-before
    check) and bind them to one CPU symmetric heap."""
    heap = heap or CpuSymmetricHeap(world)
    out = []
    for r in range(world):
        sharded = shard_graph(graph, r, world, comm_tiles)
        compiled = compile_graph(sharded.graph, num_workers, check=True)
        out.append(Rank(sharded, Interpreter(compiled.tables), RankBinder(sharded, heap.allocator(r))))
    return out


def run_ranks(ranks: Sequence[Rank], full_args: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
              seed: int = 0, iterations: int = 1) -> list[list[Any]]:
    """Run every rank's graph on its share of ``full_args`` (the unsharded graph's arguments,
    or a list of them per rank: rank-local KV caches), interleaved by ``seed``; each rank's
    graph outputs, in rank order. State inputs passed whole (the KV cache) get the ranks'
    writes back; rank-local ones are written in place."""
    rng = random.Random(seed)
    per_rank = len(full_args) == len(ranks) and all(isinstance(a, (list, tuple)) for a in full_args)
    bound, steps, backs = [], [], []
    for r, rank in enumerate(ranks):
        args, back = rank.binder.bind(full_args[r] if per_rank else full_args)
        bufs, gen = rank.interpreter.start(args, seed=rng.randrange(1 << 30), iterations=iterations)
        bound.append(bufs)
        steps.append(gen)
        backs.append(back)
    live, blocked = set(range(len(ranks))), {}
    while live:
        movable = sorted(live - blocked.keys())
        if not movable:
            raise DeadlockError(_report(blocked))
        r = rng.choice(movable)
        try:
            waits = next(steps[r])
        except StopIteration:
            live.discard(r)
            continue
        if waits:
            blocked[r] = waits
        else:
            blocked.clear()  # its puts may have released any rank
    for back in backs:
        RankBinder.write_back(back)
    return [rank.interpreter.outputs(bufs) for rank, bufs in zip(ranks, bound)]


def _report(blocked: dict[int, list[str]]) -> str:
    lines = [f"deadlock across ranks: none of ranks {sorted(blocked)} can progress."]
    for r, waits in sorted(blocked.items()):
        lines.append(f"  rank {r}: {len(waits)} ready task(s) wait on peers' signals")
        lines += [f"    {w}" for w in waits[:6]] + (["    …"] if len(waits) > 6 else [])
    return "\n".join(lines)
