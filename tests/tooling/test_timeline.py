"""The profiled launch's breakdown and SVG timeline (mpk.executors.timeline, ``mpk timeline``)
on synthetic traces in GpuExecutor.trace's format (the GPU test of the profiler checks them on
a real one: tests/gpu/test_gpu_runtime.py)."""

from __future__ import annotations

import json
import random
import re
from xml.etree import ElementTree

import pytest

from mpk.cli import main
from mpk.errors import MpkError
from mpk.executors.timeline import OTHER, PALETTE, breakdown, timeline_svg


def synthetic_trace(rng: random.Random, sms: int = 24) -> tuple[dict, list[tuple[str, str]]]:
    """Stages of ops one after another, each op's tiles on distinct SMs with random starts and
    durations, dummy tasks between them. Returns the trace and the (op, kind) stages."""
    kinds = ["rms_norm_matmul", "rope_attn_partial", "matmul", "matmul_silu_mul", "matmul"]
    stages = [(f"op{i}", k) for i, k in enumerate(kinds * 2)]
    events, t = [], rng.uniform(0.0, 3.0)
    for op, kind in stages:
        ends = []
        for sm in rng.sample(range(sms), rng.randint(3, sms)):
            ts = t + rng.uniform(0.0, 2.5)
            dur = rng.uniform(0.5, 8.0)
            events.append({"name": f"op {op!r} tile {sm}", "cat": kind, "ph": "X", "pid": 0, "tid": sm, "ts": ts,
                           "dur": dur, "args": {"task": len(events), "worker": sm, "op": op}})
            ends.append(ts + dur)
        t = max(ends) + rng.uniform(0.5, 1.5)
        events.append({"name": "dummy", "cat": "dummy", "ph": "X", "pid": 0, "tid": rng.randrange(sms),
                       "ts": t - 0.3, "dur": 0.05, "args": {"task": len(events), "worker": 0}})
    rng.shuffle(events)  # the executor writes them worker by worker, not in time order
    return {"traceEvents": events, "displayTimeUnit": "ns"}, stages


def test_breakdown_sums_each_ops_span_per_kind():
    rng = random.Random()
    trace, stages = synthetic_trace(rng)
    spans = [e for e in trace["traceEvents"] if e["cat"] != "dummy"]
    expect: dict[str, float] = {}
    for op, kind in stages:
        mine = [e for e in spans if e["args"]["op"] == op]
        expect[kind] = expect.get(kind, 0.0) + max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)
    got = breakdown(trace)
    total = max(e["ts"] + e["dur"] for e in trace["traceEvents"]) - min(e["ts"] for e in trace["traceEvents"])
    for kind, us in expect.items():
        assert got[kind] == pytest.approx(us, abs=0.051), kind
    assert got["profiled_step_us"] == pytest.approx(total, abs=0.051)
    assert got["hops_and_rest"] == pytest.approx(total - sum(expect.values()), abs=0.051)
    assert got["hops_and_rest"] > 0  # the stages do not overlap: the gaps between them are left
    assert got["tasks"] == {k: sum(e["cat"] == k for e in spans) for k in expect}
    kinds = [k for k in got if k in expect]
    assert kinds == sorted(expect, key=lambda k: -expect[k])  # largest first


def test_ops_side_by_side_leave_only_the_uncovered_time_to_the_rest():
    """Two ops whose spans overlap (independent ops of one graph) and a gap after them: each
    kind keeps its op's whole span, the rest is the launch's time no span covers (never
    negative), so the kinds add up to more than the launch."""
    rng = random.Random()
    a0, a1 = 0.0, rng.uniform(5, 10)
    b0, b1 = rng.uniform(1, 4), a1 + rng.uniform(1, 3)
    c0 = b1 + rng.uniform(0.5, 2)
    c1 = c0 + rng.uniform(1, 3)

    def span(op, kind, ts, end, sm):
        return {"name": op, "cat": kind, "ph": "X", "tid": sm, "ts": ts, "dur": end - ts, "args": {"op": op}}

    trace = {"traceEvents": [span("a", "matmul", a0, a1, 0), span("b", "rope", b0, b1, 1),
                             span("c", "matmul", c0, c1, 0)]}
    got = breakdown(trace)
    assert got["matmul"] == pytest.approx((a1 - a0) + (c1 - c0), abs=0.051)
    assert got["rope"] == pytest.approx(b1 - b0, abs=0.051)
    assert got["hops_and_rest"] == pytest.approx(c0 - b1, abs=0.051)
    assert got["matmul"] + got["rope"] + got["hops_and_rest"] > got["profiled_step_us"]


def _rects(svg: ElementTree.Element) -> dict[str, list[ElementTree.Element]]:
    return {g.get("data-kind"): g.findall("{*}rect") for g in svg.iter("{http://www.w3.org/2000/svg}g")
            if g.get("class") == "kind"}


def test_timeline_draws_every_task_on_its_lane_coloured_by_kind(tmp_path):
    rng = random.Random()
    trace, _ = synthetic_trace(rng)
    path = tmp_path / "step.json"
    path.write_text(json.dumps(trace))
    text = timeline_svg(path, tmp_path / "step.svg", title="a <synthetic> step")
    assert (tmp_path / "step.svg").read_text() == text
    svg = ElementTree.fromstring(text)  # well-formed, the title escaped
    rects = _rects(svg)
    events = trace["traceEvents"]
    assert {k: len(v) for k, v in rects.items()} == {k: sum(e["cat"] == k for e in events) for k in rects}
    # colours: the kinds by time taken, in palette order; the legend's swatches agree
    order = [k for k in breakdown(trace) if k in rects and k != "dummy"]
    fills = {g.get("data-kind"): g.get("fill") for g in svg.iter("{http://www.w3.org/2000/svg}g")}
    assert [fills[k] for k in order] == list(PALETTE[: len(order)]) and fills["dummy"] == OTHER
    swatches = {r.get("data-kind"): r.get("fill") for r in svg.iter("{http://www.w3.org/2000/svg}rect")
                if r.get("class") == "swatch"}
    assert all(swatches[k] == fills[k] for k in order) and "hops_and_rest" in swatches
    # one bar's geometry: x from its start, width from its duration, y from its SM's lane
    e = max(events, key=lambda e: e["dur"])
    t0 = min(x["ts"] for x in events)
    t1 = max(x["ts"] + x["dur"] for x in events)
    lanes = sorted({x["tid"] for x in events})
    bar = next(r for r in rects[e["cat"]] if f'{e["dur"]:.2f} µs from {e["ts"]:.2f}' in r.find("{*}title").text)
    plot_w = 1200 - 56 - 16
    assert float(bar.get("x")) == pytest.approx(56 + (e["ts"] - t0) * plot_w / (t1 - t0), abs=0.01)
    assert float(bar.get("width")) == pytest.approx(e["dur"] * plot_w / (t1 - t0), abs=0.01)
    assert float(bar.get("y")) == pytest.approx(48 + 3 * lanes.index(e["tid"]), abs=0.05)


def test_a_window_keeps_and_cuts_the_tasks_it_overlaps():
    trace, _ = synthetic_trace(random.Random())
    events = trace["traceEvents"]
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    lo, hi = t0 + 0.3 * (t1 - t0), t0 + 0.5 * (t1 - t0)
    svg = ElementTree.fromstring(timeline_svg(trace, start_us=lo, end_us=hi))
    bars = [r for rs in _rects(svg).values() for r in rs]
    assert len(bars) == sum(e["ts"] < hi and e["ts"] + e["dur"] > lo for e in events)
    left, right = 56, 1200 - 16
    assert all(left - 1e-6 <= float(r.get("x")) and float(r.get("x")) + float(r.get("width")) <= right + 0.41
               for r in bars)
    labels = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert any(re.search(r"window .* of the launch's", t) for t in labels)


def test_bad_traces_and_windows_are_named(tmp_path, capsys):
    trace, _ = synthetic_trace(random.Random())
    with pytest.raises(MpkError, match=r"window 5…5 µs is empty"):
        timeline_svg(trace, start_us=5, end_us=5)
    with pytest.raises(MpkError, match=r"no task runs in the window 1e\+06…2e\+06 µs"):
        timeline_svg(trace, start_us=1e6, end_us=2e6)
    bad = tmp_path / "not_a_trace.json"
    bad.write_text("{")
    with pytest.raises(MpkError, match="not_a_trace.json: not a readable JSON trace"):
        breakdown(bad)
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["timeline", str(tmp_path / "empty.json")]) == 2
    assert "empty.json holds no task spans" in capsys.readouterr().err


def test_mpk_timeline_writes_the_svg_and_prints_the_breakdown(tmp_path, capsys):
    trace, _ = synthetic_trace(random.Random())
    path = tmp_path / "step.json"
    path.write_text(json.dumps(trace))
    assert main(["timeline", str(path)]) == 0
    out = capsys.readouterr().out
    summary = breakdown(trace)
    for kind in summary["tasks"]:
        assert re.search(rf"^{kind} +{summary[kind]:.1f} µs .* {summary['tasks'][kind]} tasks", out, re.M), kind
    assert re.search(rf"^launch +{summary['profiled_step_us']:.1f} µs", out, re.M)
    ElementTree.parse(tmp_path / "step.svg")
    assert "whole launch" not in out
    t0 = min(e["ts"] for e in trace["traceEvents"])
    assert main(["timeline", str(path), "--start-us", str(t0 + 1), "--end-us", str(t0 + 3)]) == 0
    windowed = capsys.readouterr().out  # a window draws less, but the printed times stay the launch's: said so
    assert "the window limits the drawing; the times below are the whole launch's" in windowed
    assert re.search(rf"^launch +{summary['profiled_step_us']:.1f} µs", windowed, re.M)
