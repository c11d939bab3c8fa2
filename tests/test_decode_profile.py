"""benchmarks/decode_latency.py's reading of a profiled step's trace: each op's timeline row
and, for traces of a -DMPK_HOP_STAMPS build, its latest starters' way from their previous task."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys
from types import SimpleNamespace

import pytest

_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
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
                             meta={"ops": [{"kind": "matmul"}, {"kind": "rms_matmul"}]})
    rng.shuffle(events)  # the trace lists workers' records in no particular order
    return events, tables, ends, hops


@pytest.mark.parametrize("stamps", [False, True])
def test_stages_rows_and_late_hops(stamps: bool):
    rng = random.Random()
    workers = rng.randint(4, 12)
    events, tables, ends, hops = _trace(rng, workers, stamps)
    rows = decode_latency.stages(events, tables, first=0, count=2)
    assert [r["kind"] for r in rows] == ["matmul", "rms_matmul"] and [r["tasks"] for r in rows] == [workers] * 2
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
