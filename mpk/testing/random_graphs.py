"""Synthetic task graphs for runtime stress tests and benchmarks: ``stamp`` tasks (see
mpk/ops/diagnostic.py) wired by explicit dependencies, compiled by steps 3–7 of the real
compiler (fusion, normalization, linearization, modes, tables)."""

from __future__ import annotations

import random

import torch

from mpk.compiler.fuse import fuse
from mpk.compiler.linearize import linearize
from mpk.compiler.modes import assign_modes
from mpk.compiler.normalize import normalize
from mpk.compiler.partition import decompose
from mpk.compiler.tables import FLAG_JIT, Tables, emit
from mpk.ir.opgraph import GraphOutput, OpGraph
from mpk.ir.views import identity_view


def stamp_graph(preds: list[tuple[int, ...]], iterations: int, busy_ns: int = 0, record: bool = True) -> Tables:
    """Tables for len(preds) stamp tasks; task t waits for the tasks in preds[t] (all < t).
    ``record=False`` makes empty tasks (nothing logged) for overhead measurements."""
    n = len(preds)
    g = OpGraph()
    clock = g.add_buffer("clock", (1,), torch.int64, "input", input_index=0)
    runs = g.add_buffer("runs", (n,), torch.int64, "input", input_index=1)
    log = g.add_buffer("log", (iterations, n, 2), torch.int64, "input", input_index=2)
    views = tuple(identity_view(b.id, b.shape) for b in (clock, runs, log))
    op = g.add_op("stamp", views, (n,), torch.int64, {"busy_ns": busy_ns, "record": record}, "stamp")
    g.outputs.append(GraphOutput(view=identity_view(op.output, (n,))))
    tg = decompose(g, num_workers=n, overrides={"stamp": [n]})
    tg.preds = [tuple(sorted(p)) for p in preds]
    tg.num_edges = sum(len(p) for p in preds)
    for step in (fuse, normalize, linearize, assign_modes):
        step(tg)
    return emit(tg)


def random_dag(n: int, rng: random.Random, max_fan_in: int = 4, window: int = 512) -> list[tuple[int, ...]]:
    """Random DAG over n tasks: each task depends on up to max_fan_in earlier tasks drawn from a
    window behind it (so fan-out varies too); about a tenth of the tasks are roots."""
    preds = []
    for t in range(n):
        if t == 0 or rng.random() < 0.1:
            preds.append(())
            continue
        k = rng.randint(1, min(max_fan_in, t))
        preds.append(tuple(sorted(set(rng.randrange(max(0, t - window), t) for _ in range(k)))))
    return preds


def chain(n: int) -> list[tuple[int, ...]]:
    return [()] + [(t - 1,) for t in range(1, n)]


def independent(n: int) -> list[tuple[int, ...]]:
    return [() for _ in range(n)]


def force_jit(tables: Tables) -> Tables:
    """Every task dispatched by schedulers (to time the JIT path)."""
    tables.tasks["flags"] |= FLAG_JIT
    return tables


def stamp_inputs(tables: Tables, iterations: int, device) -> list[torch.Tensor]:
    n = int(tables.ops[0]["num_tiles"])
    return [torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device),
            torch.full((iterations, n, 2), -1, dtype=torch.int64, device=device)]
