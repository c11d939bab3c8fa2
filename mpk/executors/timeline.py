"""What a profiled launch did, from its trace (``GpuExecutor.trace``): the time per task kind
and a picture of it.

``breakdown(trace)`` splits the launch by op kind: for each op the span from its first task's
start to its last task's end, summed per kind; the time no op's span covers is event hops
and ramp-up/down (``hops_and_rest``). In a decode step the ops run one after another, so the
kinds and the rest add up to the launch; ops that run side by side make the kinds add up to
more. ``timeline_svg(trace)`` draws every task as a bar on its SM's
lane, coloured by kind, with that breakdown as the legend: the stages of a decode step, the
spread of their starts and the gaps between them are visible at a glance (``mpk timeline``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from mpk.errors import MpkError

# Tableau's 10 categorical colours: the kinds that take the most time get the first ones.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
OTHER = "#d3d3d3"  # kinds beyond the palette, and dummy tasks


def load_trace(trace: dict | str | Path) -> list[dict]:
    """The task spans (``ph == "X"``) of a trace dict or a trace file; ``MpkError`` naming the
    file when it is not a trace or holds no task."""
    where = "the trace"
    if not isinstance(trace, dict):
        where = str(trace)
        try:
            trace = json.loads(Path(trace).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MpkError(f"{where}: not a readable JSON trace ({e})") from None
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else None
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise MpkError(f"{where}: expected a Chrome trace, a JSON object whose traceEvents is a list of objects")
    events = [e for e in raw if e.get("ph") == "X"]
    bad = next((e for e in events if not all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur", "tid"))), None)
    if bad is not None:
        raise MpkError(f"{where}: task span {bad} lacks a number among ts, dur and tid")
    bad = next((e for e in events if e["dur"] < 0), None)
    if bad is not None:
        raise MpkError(f"{where}: task span {bad} has dur {bad['dur']}; expected a duration ≥ 0 µs")
    if not events:
        raise MpkError(f"{where} holds no task spans (expected a Chrome trace written by GpuExecutor.trace)")
    t_lo = min(e["ts"] for e in events)
    if max(e["ts"] + e["dur"] for e in events) <= t_lo:
        raise MpkError(f"{where}: its task spans cover no time (all start and end at {t_lo:g} µs); expected a "
                       "launch's spans")
    return events


def _op(e: dict) -> str | None:
    """The op a span belongs to (None for a dummy task)."""
    return e.get("args", {}).get("op")


def _kind(e: dict) -> str:
    """The op kind a span belongs to (its category; the op's name in a trace without one)."""
    op = _op(e)
    return "dummy" if op is None else e.get("cat", op)


def breakdown(trace: dict | str | Path) -> dict[str, Any]:
    """Per op kind the summed spans of its ops (µs), largest first, then ``hops_and_rest`` (the
    time no op's span covers), ``profiled_step_us`` (first start to last end),
    ``median_task_us`` and ``tasks`` per kind."""
    events = load_trace(trace)
    spans: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        op = _op(e)
        if op is None:
            continue
        lo_hi = spans.setdefault(op, [math.inf, -math.inf])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], e["ts"]), max(lo_hi[1], e["ts"] + e["dur"])
        kinds[op] = _kind(e)
        durations[kinds[op]].append(e["dur"])
    per_kind: dict[str, float] = defaultdict(float)
    for op, (lo, hi) in spans.items():
        per_kind[kinds[op]] += hi - lo
    # the time no op's span covers (ops of a graph that run side by side overlap: their kinds'
    # spans then add up to more than the launch; a decode step's ops run one after another)
    covered, reach = 0.0, -math.inf
    for lo, hi in sorted(spans.values()):
        covered += max(0.0, hi - max(lo, reach))
        reach = max(reach, hi)
    total = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    out: dict[str, Any] = {k: round(v, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])}
    out["hops_and_rest"] = round(total - covered, 1)
    out["profiled_step_us"] = round(total, 1)
    out["median_task_us"] = {k: round(sorted(v)[len(v) // 2], 2) for k, v in durations.items()}
    out["tasks"] = {k: len(v) for k, v in durations.items()}
    return out


def _ticks(lo: float, hi: float, target: int = 10) -> list[float]:
    """Round tick positions (1, 2 or 5 × 10^n apart) covering [lo, hi]."""
    raw = (hi - lo) / target
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    return [i * step for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def timeline_svg(trace: dict | str | Path, out: str | Path | None = None, *, start_us: float | None = None,
                 end_us: float | None = None, title: str = "", width: int = 1200, lane_px: float = 3.0) -> str:
    """An SVG of the launch: one lane per SM (top to bottom in SM order), each task a bar from
    its start to its end on the trace's µs clock, coloured by op kind; the legend lists each
    kind's summed op spans over the whole launch, its share and its tasks. ``start_us`` /
    ``end_us`` draw a window of it (tasks cut at its edges). Returns the SVG text and writes it
    to ``out`` when given."""
    events = load_trace(trace)
    t_lo = min(e["ts"] for e in events)
    t_hi = max(e["ts"] + e["dur"] for e in events)
    lo = t_lo if start_us is None else start_us
    hi = t_hi if end_us is None else end_us
    if not lo < hi:
        raise MpkError(f"window {lo:g}…{hi:g} µs is empty; expected start_us < end_us within the launch's "
                       f"{t_lo:g}…{t_hi:g} µs")
    shown = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    if not shown:
        raise MpkError(f"no task runs in the window {lo:g}…{hi:g} µs; the launch spans {t_lo:g}…{t_hi:g} µs")
    summary = breakdown({"traceEvents": events})
    kinds = [k for k in summary if k not in ("hops_and_rest", "profiled_step_us", "median_task_us", "tasks")]
    color = {k: PALETTE[i] if i < len(PALETTE) else OTHER for i, k in enumerate(kinds)}
    sms = sorted({int(e["tid"]) for e in events})
    lane = {sm: i for i, sm in enumerate(sms)}

    left, right, top = 56, 16, 48 if title else 24
    plot_w, plot_h = width - left - right, len(sms) * lane_px
    scale = plot_w / (hi - lo)
    axis_y = top + plot_h
    legend_y = axis_y + 56
    row_h = 18
    height = legend_y + row_h * (len(kinds) + 1) + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
             f'viewBox="0 0 {width} {height:.0f}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height:.0f}" fill="white"/>']
    if title:
        parts.append(f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h:.1f}" fill="#f7f7f7"/>')
    by_kind: dict[str, list[str]] = defaultdict(list)
    for e in shown:
        x0, x1 = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        kind = _kind(e)
        tip = escape(f'{e.get("name", "")}: {e["dur"]:.2f} µs from {e["ts"]:.2f}')
        by_kind[kind].append(f'<rect x="{left + (x0 - lo) * scale:.2f}" y="{top + lane[int(e["tid"])] * lane_px:.1f}" '
                             f'width="{max((x1 - x0) * scale, 0.4):.2f}" height="{lane_px * 0.85:.2f}">'
                             f'<title>{tip}</title></rect>')
    for kind, rects in by_kind.items():
        parts.append(f'<g class="kind" data-kind="{escape(kind)}" fill="{color.get(kind, OTHER)}">')
        parts.extend(rects)
        parts.append("</g>")
    for tick in _ticks(lo, hi):
        x = left + (tick - lo) * scale
        parts.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="black"/>'
                     f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{tick:g}</text>')
    window = "" if (lo, hi) == (t_lo, t_hi) else f" (window {lo:g}…{hi:g} of the launch's {t_lo:g}…{t_hi:g})"
    parts.append(f'<text x="{left + plot_w}" y="{axis_y + 30}" text-anchor="end">µs{window}</text>')
    parts.append(f'<text x="{left - 6}" y="{top + plot_h / 2:.1f}" text-anchor="end">SMs</text>'
                 f'<text x="{left - 6}" y="{top + 10}" text-anchor="end" font-size="10">{sms[0]}</text>'
                 f'<text x="{left - 6}" y="{axis_y}" text-anchor="end" font-size="10">{sms[-1]}</text>')
    total = summary["profiled_step_us"]
    rows = [(k, color[k], f'{k}: {summary[k]:.1f} µs ({summary[k] / total:.0%}), {summary["tasks"][k]} tasks, '
                          f'median {summary["median_task_us"][k]:.2f} µs') for k in kinds]
    rows.append(("hops_and_rest", "white", f'event hops and the rest: {summary["hops_and_rest"]:.1f} µs '
                                           f'({summary["hops_and_rest"] / total:.0%}) of {total:.1f} µs'))
    for i, (kind, fill, text) in enumerate(rows):
        y = legend_y + i * row_h
        parts.append(f'<rect class="swatch" data-kind="{escape(kind)}" x="{left}" y="{y - 10}" width="12" height="12" '
                     f'fill="{fill}" stroke="#888"/><text x="{left + 18}" y="{y}">{escape(text)}</text>')
    parts.append("</svg>")
    svg = "\n".join(parts) + "\n"
    if out is not None:
        Path(out).write_text(svg)
    return svg
