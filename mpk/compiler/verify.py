"""Happens-before check of emitted tables: deterministic, over every schedule at once.

For every element a task reads, every task that writes that element must be ordered before the
reader by the event graph (task → its triggering event → the tasks that event launches,
transitively, within one iteration), and no two unordered tasks may write one element. Writes
are a task's output tile, its in-place writes into inputs (``OpDef.inplace_writes``: the
KV-cache append) and accumulating writes alike; inputs addressed through run-time data are
checked in their key spaces (``OpDef.key_spaces``). Writes for the next iteration
(``OpDef.carried_writes``: the start-of-iteration task feeding tokens and the page table back)
go the other way: every other task reading or writing such an element must finish before the
writer starts. Every task must also be ordered before the end event, so one iteration ends
before the next begins.

It reads only the tables and the registry's region declarations, and maps rects through the
tables' strided views (shape, strides, offset) — not through ``View.base_regions`` or the
producer-tile search of depend.py — so it does not share their bugs.

Cost: reachability is one bitset over the linear task order per event (an event's ancestors
are the union over its triggers of the trigger and the trigger's dependent event's ancestors;
events are processed in linear order), O(events · tasks / 8) bytes. Accesses are intervals of
flat element offsets (a strided rect becomes one interval per index of its non-contiguous
dims); per buffer, the write intervals' sorted boundaries cut the buffer into segments, each
read interval is mapped to its segments by binary search and each segment to its writers, and
the resulting (writer, reader) pairs are tested against the bitsets in one vectorised lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import prod

import numpy as np

from mpk.compiler.tables import Tables, op_layouts
from mpk.errors import VerifyError
from mpk.ir.regions import Rect, tile_rect
from mpk.ops import OpSig, op_by_type_id


@dataclass
class VerifyReport:
    tasks: int
    ranges: int  # element ranges (intervals) checked, reads and writes
    pairs: int  # (writer, reader) pairs whose order was tested
    seconds: float

    def summary(self) -> str:
        return (f"verified: happens-before holds for {self.tasks} tasks over {self.ranges} element ranges "
                f"({self.pairs} writer→reader pairs) in {self.seconds * 1e3:.0f} ms")


def strided_intervals(strides, offset: int, rect: Rect) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) flat offsets of the elements ``rect`` covers in a strided view (strides ≥ 0):
    dims sorted by stride, those that continue one another merged, the innermost stride-1 run
    one interval, one interval per index of the rest."""
    base = offset
    dims = []
    for (a, b), s in zip(rect, strides):
        if b <= a:
            return _EMPTY, _EMPTY
        base += a * s
        if b - a > 1 and s:
            dims.append((s, b - a))
    dims.sort()
    merged: list[list[int]] = []
    for s, n in dims:
        if merged and merged[-1][1] * merged[-1][0] == s:
            merged[-1][0] *= n
        else:
            merged.append([n, s])
    run = 1
    if merged and merged[0][1] == 1:
        run = merged.pop(0)[0]
    if not merged:
        return np.array([base], np.int64), np.array([base + run], np.int64)
    starts = np.array([base], np.int64)
    for n, s in merged:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return starts, starts + run


_EMPTY = np.zeros(0, np.int64)


def _expand(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts[i] + j for j < counts[i], i) for every i, concatenated."""
    owner = np.repeat(np.arange(len(starts)), counts)
    off = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts[owner] + off, owner


@dataclass
class _Op:
    name: str
    kind: str
    opdef: object
    sig: OpSig
    inputs: list[int]
    output: int
    grid: tuple[int, ...]
    bounds: list[tuple[int, ...]]


class _Space:
    """One address space: a buffer's flat elements, or the key space of a buffer addressed
    through run-time data."""

    def __init__(self, name: str, shape: tuple[int, ...], dims: tuple[str, ...] | None = None):
        self.name, self.shape, self.dims = name, shape, dims
        self.w: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.r: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.c: list[tuple[np.ndarray, np.ndarray, int]] = []  # writes for the next iteration

    def coord(self, flat: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            flat, i = divmod(flat, s)
            out.append(i)
        return tuple(reversed(out))

    def describe(self, flat: int) -> str:
        c = self.coord(flat)
        if self.dims:
            return "key (" + ", ".join(f"{d} {i}" for d, i in zip(self.dims, c)) + ")"
        return f"element {c}"


def _ops(tables: Tables) -> list[_Op]:
    return [_Op(m["name"], m["kind"], op_by_type_id(int(o["type_id"])), lay.sig, lay.inputs, lay.output, lay.grid,
                lay.bounds) for o, m, lay in zip(tables.ops, tables.meta["ops"], op_layouts(tables))]


def _flat(accesses: list[tuple[np.ndarray, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One space's accesses (interval starts, ends, task) as flat arrays of starts, ends and the
    task of each interval."""
    lo = np.concatenate([x[0] for x in accesses])
    hi = np.concatenate([x[1] for x in accesses])
    return lo, hi, np.repeat(np.array([x[2] for x in accesses], np.int64), [len(x[0]) for x in accesses])


def _reachability(tables: Tables) -> np.ndarray:
    """anc[e]: bitset (little bit order, packed) over tasks of the tasks that have finished
    whenever event e has fired in an iteration."""
    tasks, events = tables.tasks, tables.events
    n, E = len(tasks), len(events)
    dep = tasks["dep_event"].astype(np.int64)
    trig = tasks["trig_event"].astype(np.int64)
    first = events["first_task"].astype(np.int64)
    end = tables.end_event
    ids = np.arange(n)
    bad = np.nonzero((trig != end) & (first[trig] <= ids))[0]
    if len(bad):
        t = int(bad[0])
        raise VerifyError(f"task {t} triggers event {int(trig[t])}, which launches tasks from {int(first[trig[t]])}: "
                          "the linear order is not topological, so happens-before is undefined")
    anc = np.zeros((E, (n + 7) // 8), np.uint8)
    order = np.argsort(trig, kind="stable")
    cuts = np.searchsorted(trig[order], np.arange(E + 1))
    last_trigger = np.full(E, -1, np.int64)
    for e in range(E):
        if cuts[e + 1] > cuts[e]:
            last_trigger[e] = order[cuts[e + 1] - 1]
    # an event's ancestors need those of its triggers' dependent events, which fired before its
    # last trigger ran: process events by their last trigger's linear position
    for e in np.argsort(last_trigger, kind="stable").tolist():
        ts = order[cuts[e]: cuts[e + 1]]
        if not len(ts):
            continue  # the start event
        if int(events["num_triggers"][e]) < len(ts):
            raise VerifyError(f"event {e} fires after {int(events['num_triggers'][e])} arrivals but {len(ts)} tasks "
                              f"trigger it (tasks {ts[:6].tolist()}…): it orders none of them before what it launches",
                              writer=int(ts[0]))
        deps = np.unique(dep[ts])
        row = np.bitwise_or.reduce(anc[deps], axis=0) if len(deps) > 1 else anc[deps[0]].copy()
        np.bitwise_or.at(row, ts >> 3, (1 << (ts & 7)).astype(np.uint8))
        anc[e] = row
    return anc


def _carried(sp: _Space, n: int, ordered, bad: dict, max_pairs: int) -> int:
    """Every access to ``sp`` overlapping a write for the next iteration (``sp.c``) by another
    task must be ordered before that writer, and two such writers one way or the other; the
    failures go into ``bad`` keyed (writer, other) as "carried". Returns the pairs tested."""
    clo, chi, ct = _flat(sp.c)
    cuts = np.unique(np.concatenate([clo, chi]))
    s0, s1 = np.searchsorted(cuts, clo), np.searchsorted(cuts, chi)
    seg, owner = _expand(s0, s1 - s0)
    key = np.unique(seg * n + ct[owner])
    seg_of, writer_of = key // n, key % n
    seg_ptr = np.searchsorted(seg_of, np.arange(len(cuts)))
    olo, ohi, ot = _flat(sp.r + sp.w + sp.c)
    carried = np.concatenate([np.zeros(len(olo) - len(clo), bool), np.ones(len(clo), bool)])
    k0 = np.maximum(np.searchsorted(cuts, olo, "right") - 1, 0)
    k1 = np.minimum(np.searchsorted(cuts, ohi, "left"), len(cuts) - 1)
    segs, oi = _expand(k0, np.maximum(k1 - k0, 0))
    wi, pi = _expand(seg_ptr[segs], seg_ptr[segs + 1] - seg_ptr[segs])
    w, o, both, where = writer_of[wi], ot[oi[pi]], carried[oi[pi]], cuts[segs[pi]]
    keep = w != o
    w, o, both, where = w[keep], o[keep], both[keep], where[keep]
    fine = ordered(o, w) | (both & ordered(w, o))
    for j in np.nonzero(~fine)[0].tolist():
        if len(bad) >= max_pairs:
            break
        bad.setdefault((int(w[j]), int(o[j])), ("carried", sp, int(where[j])))
    return len(w)


def verify(tables: Tables, max_pairs: int = 1000) -> VerifyReport:
    """Check happens-before over the tables (module docstring); raises ``VerifyError`` naming
    the first unordered pair — both tasks (op name, kind, tile), the buffer, an element and the
    missing order — with every unordered pair found (up to ``max_pairs``) in ``.pairs``."""
    t0 = time.perf_counter()
    tasks = tables.tasks
    n = len(tasks)
    ops = _ops(tables)
    dep = tasks["dep_event"].astype(np.int64)
    trig = tasks["trig_event"].astype(np.int64)
    anc = _reachability(tables)
    anc_tasks = np.unpackbits(anc[tables.end_event], bitorder="little")[:n] if n else np.zeros(0, np.uint8)
    missing = np.nonzero(anc_tasks == 0)[0]
    bnames = [b["name"] for b in tables.meta["buffers"]]
    task_op, task_tile = tasks["op"].tolist(), tasks["tile"].tolist()

    def rect_of(t: int) -> Rect:
        op = ops[task_op[t]]
        return tile_rect(op.grid, op.bounds, task_tile[t])

    def describe(t: int) -> str:
        if task_op[t] < 0:
            return f"task {t} (dummy)"
        op = ops[task_op[t]]
        return f"task {t} (op {op.name!r}, {op.kind}, tile {rect_of(t)})"

    if len(missing):
        t = int(missing[0])
        raise VerifyError(f"{describe(t)} is not ordered before the end event {tables.end_event}: the next iteration "
                          f"could start while it runs ({len(missing)} such task(s))", writer=t)

    views = [(int(v["buffer"]), tuple(int(s) for s in v["strides"][: v["ndim"]]), int(v["offset"]))
             for v in tables.views]
    bshape = [tuple(int(s) for s in b["shape"][: b["ndim"]]) for b in tables.buffers]
    # key spaces first: a plain access to a keyed buffer then counts as the whole space
    keyed: dict[int, _Space] = {}
    op_keys: list[dict[int, object]] = []
    for op in ops:
        ks = {k.input: k for k in (op.opdef.key_spaces(op.sig) if op.opdef.key_spaces else [])}
        op_keys.append(ks)
        for k in ks.values():
            b = views[op.inputs[k.input]][0]
            sp = keyed.setdefault(b, _Space(bnames[b], tuple(k.shape), tuple(k.dims)))
            if sp.shape != tuple(k.shape):
                raise VerifyError(f"op {op.name!r} ({op.kind}) addresses buffer {bnames[b]!r} through keys of shape "
                                  f"{tuple(k.shape)}, another op through {sp.shape}: their accesses cannot be related")
    spaces: dict[int, _Space] = dict(keyed)

    def space(b: int) -> _Space:
        if b not in spaces:
            spaces[b] = _Space(bnames[b], bshape[b])
        return spaces[b]

    def whole(b: int):
        k = prod(spaces[b].shape)
        return np.zeros(1, np.int64), np.full(1, k, np.int64)

    contiguous = {}
    reads: list[tuple[int, int, int | None, Rect]] = []  # (task, view, key input or None, rect)
    for t in range(n):
        o = task_op[t]
        if o < 0:
            continue
        op = ops[o]
        rect = rect_of(t)
        if op.output not in contiguous:
            sh = bshape[op.output]
            contiguous[op.output] = tuple(prod(sh[i + 1:]) for i in range(len(sh)))
        sp = space(op.output)
        lo, hi = whole(op.output) if op.output in keyed else strided_intervals(contiguous[op.output], 0, rect)
        sp.w.append((lo, hi, t))
        for i, r in (op.opdef.inplace_writes(op.sig, rect) if op.opdef.inplace_writes else []):
            b, strides, off = views[op.inputs[i]]
            if i in op_keys[o]:
                ks = op_keys[o][i]
                lo, hi = strided_intervals(tuple(prod(ks.shape[j + 1:]) for j in range(len(ks.shape))), 0, r)
            elif b in keyed:
                lo, hi = whole(b)
            else:
                lo, hi = strided_intervals(strides, off, r)
            space(b).w.append((lo, hi, t))
        for i, r in (op.opdef.carried_writes(op.sig, rect) if op.opdef.carried_writes else []):
            b, strides, off = views[op.inputs[i]]
            lo, hi = whole(b) if b in keyed else strided_intervals(strides, off, r)
            space(b).c.append((lo, hi, t))
        for i, r in enumerate(op.opdef.input_regions(op.sig, rect)):
            if i in op_keys[o]:
                r = op_keys[o][i].reads(op.sig, rect)
            if r is not None:
                reads.append((t, op.inputs[i], i if i in op_keys[o] else None, r))
    memo: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # many tiles read one region (all of x)
    for t, v, ki, r in reads:
        b, strides, off = views[v]
        sp = spaces.get(b)
        if sp is None or not (sp.w or sp.c):
            continue  # nothing writes it (weights, plain inputs)
        key = (v, ki is not None, r)
        got = memo.get(key)
        if got is None:
            if ki is not None:
                got = strided_intervals(tuple(prod(sp.shape[j + 1:]) for j in range(len(sp.shape))), 0, r)
            elif b in keyed:
                got = whole(b)
            else:
                got = strided_intervals(strides, off, r)
            memo[key] = got
        sp.r.append((got[0], got[1], t))

    def ordered(w: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Whether task w has finished whenever task r starts (elementwise)."""
        return ((anc[dep[r], w >> 3] >> (w & 7)) & 1).astype(bool)

    ranges = pairs_checked = 0
    bad: dict[tuple[int, int], tuple[str, _Space, int]] = {}  # (writer, reader) -> (kind, space, flat)
    for b in sorted(spaces):
        sp = spaces[b]
        if sp.c:
            pairs_checked += _carried(sp, n, ordered, bad, max_pairs)
        if not sp.w:
            continue
        wlo, whi, wt = _flat(sp.w)
        ranges += len(wlo)
        cuts = np.unique(np.concatenate([wlo, whi]))
        s0, s1 = np.searchsorted(cuts, wlo), np.searchsorted(cuts, whi)
        seg, owner = _expand(s0, s1 - s0)
        key = np.unique(seg * n + wt[owner])  # (segment, writer), sorted by segment
        seg_of, writer_of = key // n, key % n
        seg_ptr = np.searchsorted(seg_of, np.arange(len(cuts)))
        # two writers of one segment: each must be ordered before the other's start or after its end
        multi = np.nonzero(np.diff(seg_of) == 0)[0]
        if len(multi):
            for s in np.unique(seg_of[multi]).tolist():
                ws = writer_of[seg_ptr[s]: seg_ptr[s + 1]]
                a, c = np.meshgrid(ws, ws, indexing="ij")
                keep = a < c
                a, c = a[keep], c[keep]
                pairs_checked += len(a)
                loose = ~(ordered(a, c) | ordered(c, a))
                for x, y in zip(a[loose].tolist(), c[loose].tolist()):
                    bad.setdefault((x, y), ("write", sp, int(cuts[s])))
        if not sp.r:
            continue
        rlo, rhi, rt = _flat(sp.r)
        ranges += len(rlo)
        k0 = np.maximum(np.searchsorted(cuts, rlo, "right") - 1, 0)
        k1 = np.minimum(np.searchsorted(cuts, rhi, "left"), len(cuts) - 1)
        segs, ri = _expand(k0, np.maximum(k1 - k0, 0))
        wi, pi = _expand(seg_ptr[segs], seg_ptr[segs + 1] - seg_ptr[segs])
        w, r = writer_of[wi], rt[ri[pi]]
        pair = np.unique(w * n + r)
        pair = pair[pair // n != pair % n]
        pw, pr = pair // n, pair % n
        pairs_checked += len(pair)
        fails = np.nonzero(~ordered(pw, pr))[0]
        if len(fails):
            fail_set = set((pw[fails] * n + pr[fails]).tolist())
            hit = np.nonzero(np.isin(w * n + r, list(fail_set)))[0]
            for j in hit.tolist():
                key2 = (int(w[j]), int(r[j]))
                if key2 not in bad and len(bad) < max_pairs:
                    s = int(segs[pi[j]])
                    bad[key2] = ("read", sp, int(max(cuts[s], rlo[ri[pi[j]]])))
    report = VerifyReport(n, ranges, pairs_checked, time.perf_counter() - t0)
    if bad:
        (w, r), (what, sp, flat) = min(bad.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        where = f"buffer {sp.name!r} {sp.describe(flat)}"
        if what == "carried":
            msg = (f"{describe(r)} reads or writes {where}, which {describe(w)} writes for the next iteration, but "
                   f"no event path orders it before that writer (it triggers event {int(trig[r])}; the writer waits "
                   f"on event {int(dep[w])}, which does not follow it)")
        elif what == "read":
            msg = (f"{describe(r)} reads {where}, which {describe(w)} writes, but no event path orders the "
                   f"writer first (the writer triggers event {int(trig[w])}; the reader waits on event "
                   f"{int(dep[r])}, which does not follow it)")
        else:
            msg = (f"{describe(w)} and {describe(r)} both write {where}, and no event path orders one before "
                   f"the other (events {int(trig[w])} → … → {int(dep[r])} and {int(trig[r])} → … → {int(dep[w])} "
                   "are both missing)")
        raise VerifyError(f"happens-before check failed: {msg}; {len(bad)} unordered pair(s) in all",
                          writer=w, reader=r, buffer=sp.name, element=sp.coord(flat), pairs=frozenset(bad))
    return report
