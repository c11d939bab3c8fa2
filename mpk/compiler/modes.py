"""Step 6 — modes: label each task JIT or AOT.

AOT tasks are placed on workers' queues ahead of time and wait there for their dependent
event; JIT tasks are handed to an idle worker by a scheduler when their event fires. Tasks of
data-dependent ops (attention: its work depends on sequence lengths known only at run time)
are JIT, and so is everything launched downstream of a JIT task until a global barrier: an
event whose ancestors include every JIT task linearized before it. When such an event fires
no data-dependent work can still be in flight, so static placement is exact again. (Requiring
*all* earlier tasks as ancestors would almost never hold: independent work, such as copies that
depend only on the start event, is linearized first and feeds later layers.)
"""

from __future__ import annotations

from mpk.compiler.taskgraph import TaskGraph
from mpk.errors import CompileError
from mpk.ops import get_op


def check_linear_order(tg: TaskGraph) -> None:
    """CompileError naming the first fault unless ``tg.task_order`` / ``tg.event_order`` (step 5,
    mpk/compiler/linearize.py, or an order set by hand) hold every task and event once and each
    event comes after the events its triggering tasks wait on."""
    for name, order, n in (("task_order", tg.task_order, tg.num_tasks), ("event_order", tg.event_order, len(tg.events))):
        bad = [x for x in order if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n]
        if bad:
            raise CompileError(f"{name} holds {bad[:5]!r}, not ids in [0, {n}); expected a permutation of "
                               f"range({n}) (run mpk.compiler.linearize.linearize first)")
        if len(order) != n or len(set(order)) != n:
            missing = sorted(set(range(n)) - set(order))[:5]
            raise CompileError(f"{name} has {len(order)} entries ({len(set(order))} distinct) for {n} ids"
                               + (f", lacking {missing}" if missing else "")
                               + f"; expected a permutation of range({n}) (run mpk.compiler.linearize.linearize first)")
    dep_event = [0] * tg.num_tasks
    for ei, e in enumerate(tg.events):
        for t in e.launches:
            dep_event[t] = ei
    placed: set[int] = set()
    for ei in tg.event_order:
        early = [t for t in tg.events[ei].triggers if dep_event[t] not in placed]
        if early:
            raise CompileError(f"event_order puts event {ei} before event {dep_event[early[0]]}, which launches its "
                               f"triggering task {early[0]}; expected a topological order")
        placed.add(ei)


def assign_modes(tg: TaskGraph) -> TaskGraph:
    check_linear_order(tg)
    data_dependent = {op.id for op in tg.graph.ops if get_op(op.kind).data_dependent}
    jit = [tg.task_op[t] in data_dependent for t in range(tg.num_tasks)]
    barrier = [False] * len(tg.events)
    dep_event = [0] * tg.num_tasks
    for ei, e in enumerate(tg.events):
        for t in e.launches:
            dep_event[t] = ei
    position = {t: i for i, t in enumerate(tg.task_order)}
    ancestors: dict[int, int] = {}  # per event: bitset over linear positions
    jit_before = 0  # bitset of JIT tasks at positions already emitted
    for ei in tg.event_order:
        e = tg.events[ei]
        bits = 0
        for t in e.triggers:
            bits |= ancestors[dep_event[t]] | (1 << position[t])
        ancestors[ei] = bits
        # a barrier closes a JIT region: JIT work came before, and all of it is an ancestor
        barrier[ei] = jit_before != 0 and bits & jit_before == jit_before
        if not barrier[ei] and any(jit[t] for t in e.triggers):
            for t in e.launches:
                jit[t] = True
        for t in e.launches:
            if jit[t]:
                jit_before |= 1 << position[t]
    tg.jit, tg.barrier = jit, barrier
    return tg
