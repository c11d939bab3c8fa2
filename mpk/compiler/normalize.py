"""Step 4 — normalize: every task waits on exactly one event and triggers exactly one.

After fusion each task is launched by exactly one event (its predecessor set names it), but a
producer may trigger several events (its consumers have different predecessor sets). Producers
with the same set of triggered events {E1..Ek} form a class D; the class triggers one new event
that launches k dummy tasks, and dummy j triggers Ej in place of D. Tasks nothing consumes
trigger the end event, which fires once the whole iteration is done. A graph without ops gets
one dummy task, so that every iteration has something to fire its end event.
"""

from __future__ import annotations

from collections import defaultdict

from mpk.compiler.taskgraph import DUMMY, Event, TaskGraph
from mpk.errors import CompileError


def normalize(tg: TaskGraph) -> TaskGraph:
    events = tg.events
    start = next(i for i, e in enumerate(events) if e.triggers == ())
    if tg.num_tasks == 0:  # no ops (outputs are views of inputs): one dummy lets the end event fire
        tg.task_op.append(DUMMY)
        tg.task_tile.append(0)
        events[start] = Event((), (0,))
    triggered: dict[int, list[int]] = defaultdict(list)
    for ei, e in enumerate(events):
        for t in e.triggers:
            triggered[t].append(ei)
    # Producer classes: tasks that trigger the same ≥2 events.
    classes: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for t in range(tg.num_tasks):
        evs = triggered.get(t, [])
        if len(evs) > 1:
            classes[tuple(evs)].append(t)
    sinks = [t for t in range(tg.num_tasks) if not triggered.get(t)]
    triggers = [set(e.triggers) for e in events]
    launches = [list(e.launches) for e in events]
    for evs, members in sorted(classes.items(), key=lambda kv: kv[1][0]):
        fan = len(launches)
        launches.append([])
        triggers.append(set(members))
        for ei in evs:
            dummy = len(tg.task_op)
            tg.task_op.append(DUMMY)
            tg.task_tile.append(0)
            launches[fan].append(dummy)
            triggers[ei] -= set(members)
            triggers[ei].add(dummy)
    end = len(launches)
    triggers.append(set(sinks))
    launches.append([])
    tg.events = [Event(tuple(sorted(t)), tuple(l)) for t, l in zip(triggers, launches)]
    tg.start_event, tg.end_event = start, end
    _check(tg)
    return tg


def _check(tg: TaskGraph) -> None:
    """Invariant: every task has exactly one dependent and one triggering event."""
    dep = [0] * tg.num_tasks
    trig = [0] * tg.num_tasks
    for e in tg.events:
        for t in e.launches:
            dep[t] += 1
        for t in e.triggers:
            trig[t] += 1
    bad = [t for t in range(tg.num_tasks) if dep[t] != 1 or trig[t] != 1]
    if bad:
        t = bad[0]
        raise CompileError(f"normalization left task {t} (op {tg.task_op[t]}) with {dep[t]} dependent and "
                           f"{trig[t]} triggering events; expected exactly one of each")
