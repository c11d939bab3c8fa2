"""benchmarks/decode_latency.py's reading of a profiled step's trace: each op's timeline row
and, for traces of a -DMPK_HOP_STAMPS build, its latest starters' way from their previous task."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys
from types import SimpleNamespace

import pytest

_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))  # decode_latency imports peer from beside it
_spec = importlib.util.spec_from_file_location("decode_latency", _DIR / "decode_latency.py")
decode_latency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_latency)


def _trace(rng: random.Random, workers: int, stamps: bool):
    """Two ops of ``workers`` tasks each, task w of both on worker w: op 0's tasks end at random
    times, op 1's start after them with random hops; a dummy task (op −1) on worker 0 between,
    which is part of that worker's hop (thread 0 completes dummies in passing)."""
    events, ends = [], []
    for w in range(workers):
        ts = rng.uniform(0, 5)
        dur = rng.uniform(1, 10)
        events.append({"ts": ts, "dur": dur, "args": {"task": w, "worker": w}})
        ends.append(ts + dur)
    events.append({"ts": ends[0] + 0.01, "dur": 0.0, "args": {"task": 2 * workers, "worker": 0}})  # dummy
    hops = []
    for w in range(workers):
        end_ready, ready_gate, gate_open = (rng.uniform(0.1, 3) for _ in range(3))
        ready = ends[w] + end_ready
        args = {"task": workers + w, "worker": w}
        if stamps:
            args.update(ready=ready, gate=ready + ready_gate)
        events.append({"ts": ready + ready_gate + gate_open, "dur": rng.uniform(1, 5), "args": args})
        hops.append((end_ready, ready_gate, gate_open))
    ops = {t: 0 for t in range(workers)} | {workers + t: 1 for t in range(workers)} | {2 * workers: -1}
    tables = SimpleNamespace(tasks={t: {"op": op} for t, op in ops.items()},
                             meta={"ops": [{"kind": "matmul", "attrs": {}},
                                            {"kind": "matmul", "attrs": {"prologue": "rms_norm"}}]})
    rng.shuffle(events)  # the trace lists workers' records in no particular order
    return events, tables, ends, hops


@pytest.mark.parametrize("stamps", [False, True])
def test_stages_rows_and_late_hops(stamps: bool):
    rng = random.Random()
    workers = rng.randint(4, 12)
    events, tables, ends, hops = _trace(rng, workers, stamps)
    rows = decode_latency.stages(events, tables, first=0, count=2)
    assert [r["kind"] for r in rows] == ["matmul", "rms_norm_matmul"] and [r["tasks"] for r in rows] == [workers] * 2
    op1 = sorted((e for e in events if e["args"]["task"] >= workers and e["args"]["task"] < 2 * workers),
                 key=lambda e: e["ts"])
    assert rows[1]["start_spread"] == pytest.approx(op1[-1]["ts"] - op1[0]["ts"], abs=0.006)
    assert rows[1]["gap"] == pytest.approx(op1[0]["ts"] - max(ends), abs=0.006)
    assert "late_hop" not in rows[0]  # op 0's tasks are its workers' first: no previous task
    if not stamps:
        assert "late_hop" not in rows[1]
        return
    late = [hops[e["args"]["task"] - workers] for e in op1[-3:]]
    want = [sorted(h[i] for h in late)[len(late) // 2] for i in range(3)]
    got = rows[1]["late_hop"]
    assert [got["end_ready"], got["ready_gate"], got["gate_open"]] == pytest.approx(want, abs=0.006)


_tails_spec = importlib.util.spec_from_file_location("stage_tails", _DIR / "stage_tails.py")
stage_tails = importlib.util.module_from_spec(_tails_spec)
_tails_spec.loader.exec_module(stage_tails)


@pytest.mark.parametrize("tail", [True, False])
def test_stage_tails_sees_whether_late_starters_are_a_tail(tail):
    """benchmarks/stage_tails.py's analysis on synthetic steps of three 40-task ops over 44
    workers (4 sit out each op, in turn). The third op's tasks start 4 µs after their worker's
    task of the second ended, and no sooner than 0.5 µs after that op's last task did. With
    a tail (the second op's last 4 tasks end 5 µs after the rest) leaving those workers out
    removes the third op's late starters; with the second op's ends spread evenly over 4 µs it
    barely narrows the spread. Every step is the same up to jitter smaller than the gaps
    between ends, so the same SMs (here: workers) finish last in each."""
    import numpy as np

    rng = np.random.default_rng(random.randrange(1 << 30))  # replayable: conftest seeds random
    rows, W, n = [], 44, 40
    for step in range(3):
        end1 = {}
        for i in range(n):  # op 0 (workers 0…39), then op 1 (workers 4…43)
            rows.append((step, i, i, 0, i, 0, 10000, -1, -1))
            w = 4 + i
            end = (25000 + 10 * i if tail and i >= n - 4 else 20000 + (int(rng.integers(0, 400)) if tail else 100 * i)) \
                + int(rng.integers(0, 20))
            rows.append((step, w, w, 1, n + i, 11000, end, -1, -1))
            end1[w] = end
        fire = max(end1.values())
        for i in range(n):  # op 2: workers 8…43 and 0…3
            w = (8 + i) % W
            start = max(end1[w] + 4000, fire + 500) if w in end1 else fire + 500
            rows.append((step, w, w, 2, 2 * n + i, start, start + 10000, -1, -1))
    rec = np.array(rows, dtype=[(f, np.int64) for f in stage_tails.FIELDS])
    out = stage_tails.analyse(rec, ["matmul"] * 3)
    third = next(r for r in out if r["stage"] == "matmul → matmul → matmul")
    assert third["stages"] == 3 and third["same_last4_sms_next_step"] == 1.0 == third["same_last4_workers_next_step"]
    if tail:
        assert third["last_minus_5th"] >= 4.5 and third["spread_skip4"] < 0.2 * third["spread"]
    else:
        assert third["last_minus_5th"] < 0.6 and third["spread_skip4"] > 0.8 * third["spread"]
