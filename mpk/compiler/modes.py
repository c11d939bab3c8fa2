"""Step 6 — modes: label each task JIT or AOT.

AOT tasks are placed on workers' queues ahead of time and wait there for their dependent
event; JIT tasks are handed to an idle worker by a scheduler when their event fires. Tasks of
data-dependent ops (attention: its work depends on sequence lengths known only at run time)
are JIT, and so is everything launched downstream of a JIT task until a global barrier: an
event whose ancestors are every task linearized before it, so that no earlier work can still be
in flight when it fires. After a barrier, static placement is exact again.
"""

from __future__ import annotations

from mpk.compiler.taskgraph import TaskGraph
from mpk.ops import get_op


def assign_modes(tg: TaskGraph) -> TaskGraph:
    data_dependent = {op.id for op in tg.graph.ops if get_op(op.kind).data_dependent}
    jit = [tg.task_op[t] in data_dependent for t in range(tg.num_tasks)]
    barrier = [False] * len(tg.events)
    dep_event = [0] * tg.num_tasks
    for ei, e in enumerate(tg.events):
        for t in e.launches:
            dep_event[t] = ei
    position = {t: i for i, t in enumerate(tg.task_order)}
    first_position = {}
    for ei in tg.event_order:
        launches = tg.events[ei].launches
        first_position[ei] = position[launches[0]] if launches else len(tg.task_order)
    # Ancestor sets as bitsets over linear positions, one per event, built in BFS order.
    ancestors: dict[int, int] = {}
    need_barriers = any(jit)
    for ei in tg.event_order:
        e = tg.events[ei]
        if need_barriers:
            bits = 0
            for t in e.triggers:
                bits |= ancestors[dep_event[t]] | (1 << position[t])
            ancestors[ei] = bits
            barrier[ei] = bits.bit_count() == first_position[ei]
        jit_trigger = any(jit[t] for t in e.triggers)
        if jit_trigger and not barrier[ei]:
            for t in e.launches:
                jit[t] = True
    tg.jit, tg.barrier = jit, barrier
    return tg

