"""Step 3 — fuse: merge events to a fixpoint of successor-set and predecessor-set fusion.

Unfused, every edge (t1, t2) is its own event (one trigger, one launch). Successor-set fusion
merges events that launch the same task set (their triggers are unioned); predecessor-set
fusion merges events with the same trigger set (their launches are unioned). Both preserve the
edge set exactly (T×L of a merged event is the union of the parts).

The fixpoint is reached in two passes. The per-edge events are never built: successor-set
fusion of them is exactly "one event per consumer, triggered by its predecessors". Predecessor-
set fusion of those merges consumers with equal predecessor sets. After it, launch sets are
disjoint (each task is launched by one event) and trigger sets distinct, so neither fusion can
merge anything more (``is_fixpoint``; the tests check it on random graphs). Tasks with no
predecessors share the event with the empty trigger set: the start event.
"""

from __future__ import annotations

from mpk.compiler.taskgraph import Event, TaskGraph


def successor_set_fusion(events: list[Event]) -> list[Event]:
    merged: dict[tuple[int, ...], set[int]] = {}
    for e in events:
        merged.setdefault(e.launches, set()).update(e.triggers)
    return [Event(tuple(sorted(t)), l) for l, t in merged.items()]


def predecessor_set_fusion(events: list[Event]) -> list[Event]:
    merged: dict[tuple[int, ...], set[int]] = {}
    for e in events:
        merged.setdefault(e.triggers, set()).update(e.launches)
    return [Event(t, tuple(sorted(l))) for t, l in merged.items()]


def is_fixpoint(events: list[Event]) -> bool:
    """Neither fusion merges anything more."""
    return len(successor_set_fusion(events)) == len(events) == len(predecessor_set_fusion(events))


def fuse(tg: TaskGraph) -> TaskGraph:
    per_consumer = [Event(p, (t,)) for t, p in enumerate(tg.preds)]  # successor-set fusion of edges
    events = predecessor_set_fusion(per_consumer)
    # Deterministic order: by first launched task.
    events.sort(key=lambda e: e.launches)
    if not any(e.triggers == () for e in events):
        events.insert(0, Event((), ()))  # every graph has a start event, even if nothing uses it
    tg.events_before_fusion = tg.num_edges
    tg.events_after_fusion = len(events)
    tg.events = events
    return tg
