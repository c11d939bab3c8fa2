"""Where a decode stage's late starters come from: per-task records of several profiled steps,
and what a stage would lose if the previous stage's last finishers sat it out.

A stage here is one op's tasks (in start order). For each stage after an op of many tasks it
prints, over the profiled steps' layers (medians): the start spread (first to last gate
opening, µs), the same without the tasks whose worker was among the previous stage's last
``k`` finishers (k = 4, 8: what a placement that skipped exactly those workers could reach at
best), how late the previous stage's last finisher was after its 5th- and 9th-last, and how
often the last finishers are the same SMs from step to step (is lateness a property of the SM,
which a static placement could know, or of the moment?). A ``-DMPK_HOP_STAMPS`` build adds each
late starter's way from its previous task (end → task in hand → gate reached).

    python benchmarks/stage_tails.py --models llama3.2-1b --batches 1 --steps 8 --out-dir tails/

Writes the raw records (``<model>-b<batch>.npz``: step, worker, sm, op, task, start, end,
ready, gate in ns, −1 where not stamped) to ``--out-dir`` for further study.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import add_step_args, compile_step, max_len, random_model  # noqa: E402
from peer import require_cuda  # noqa: E402

from mpk.backend import COMPILED, RUNNERS, last_args  # noqa: E402
from mpk.executors.gpu import GpuExecutor  # noqa: E402
from mpk.llm import SHAPES  # noqa: E402

FIELDS = ("step", "worker", "sm", "op", "task", "start", "end", "ready", "gate")  # ns; ready, gate: −1 unstamped


def records(model_name: str, batch: int, position: int, page_size: int, steps: int,
            options: dict) -> tuple[np.ndarray, list[str]]:
    """Per-task profile records of ``steps`` decode steps (structured array, FIELDS; each
    step's times from the executor's trace, on its own clock), and each op's kind."""
    model = random_model(SHAPES[model_name], max_len(position))
    step, kv = compile_step(model, batch, position, page_size, options)
    tokens = torch.randint(0, model.cfg.vocab, (batch,), device="cuda")
    rows = []
    with torch.no_grad():
        step(tokens, *kv.args())  # trace, compile, build
        torch.cuda.synchronize()
        compiled = COMPILED[-1]
        ex = GpuExecutor(compiled.tables, profile=True, profile_capacity=4096)
        args = last_args(RUNNERS[id(compiled)])
        ex.run(args)  # warm-up
        ops = compiled.tables.tasks["op"]
        for s in range(steps):
            ex.run(args)
            for e in ex.trace()["traceEvents"]:
                a = e["args"]
                ns = [round(1e3 * x) for x in (e["ts"], e["ts"] + e["dur"])]
                stamps = [round(1e3 * a[k]) if k in a else -1 for k in ("ready", "gate")]
                rows.append((s, a["worker"], e["tid"], int(ops[a["task"]]), a["task"], *ns, *stamps))
        kinds = [o["kind"] for o in compiled.tables.meta["ops"]]
    del step
    torch._dynamo.reset()
    return np.array(rows, dtype=[(f, np.int64) for f in FIELDS]), kinds


def analyse(rec: np.ndarray, kinds: list[str], min_tasks: int = 32) -> list[dict]:
    """Per stage (keyed by its op's kind and the two before it: its place in a layer), medians
    over the steps' layers of the statistics the module doc lists."""
    out: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    last_sets: dict[tuple, list[tuple]] = defaultdict(list)  # (step, occurrence, last 4 SMs, last 4 workers)
    for s in np.unique(rec["step"]):
        r = rec[(rec["step"] == s) & (rec["op"] >= 0)]
        by_op = {op: r[r["op"] == op] for op in np.unique(r["op"])}
        order = sorted(by_op, key=lambda op: by_op[op]["start"].min())
        seen: dict[tuple, int] = defaultdict(int)  # the stage's occurrence in this step (its layer)
        for i, (p, n) in enumerate(zip(order, order[1:])):
            P, N = by_op[p], by_op[n]
            if len(P) < min_tasks or len(N) < min_tasks:
                continue
            fin = P[np.argsort(P["end"])]
            fire = fin["end"][-1]
            key = (kinds[order[i - 1]] if i else "-", kinds[p], kinds[n], len(P), len(N))
            stats = out[key]
            start = N["start"]
            stats["spread"].append((start.max() - start.min()) / 1e3)
            for k in (4, 8):
                late = set(fin["worker"][-k:].tolist())
                keep = start[~np.isin(N["worker"], list(late))]
                stats[f"spread_skip{k}"].append((keep.max() - start.min()) / 1e3)
            stats["last_minus_5th"].append((fire - fin["end"][-5]) / 1e3)
            stats["last_minus_9th"].append((fire - fin["end"][-9]) / 1e3)
            stats["open_after_fire_median"].append((np.median(start) - fire) / 1e3)
            # the late starters of N: were they among P's last finishers?
            late_start = N["worker"][np.argsort(N["start"])[-4:]]
            stats["late4_in_last8_of_prev"].append(np.isin(late_start, fin["worker"][-8:]).mean())
            stamped = N[N["gate"] >= 0]
            if len(stamped):
                ls = stamped[np.argsort(stamped["start"])[-3:]]
                prev_end = {int(w): int(e) for w, e in zip(fin["worker"], fin["end"])}
                ways = [(int(x["ready"]) - prev_end[int(x["worker"])], int(x["gate"]) - int(x["ready"]),
                         int(x["start"]) - int(x["gate"])) for x in ls if int(x["worker"]) in prev_end]
                if ways:
                    stats["late_end_ready"].append(np.median([w[0] for w in ways]) / 1e3)
                    stats["late_ready_gate"].append(np.median([w[1] for w in ways]) / 1e3)
            last_sets[key].append((int(s), seen[key], set(fin["sm"][-4:].tolist()), set(fin["worker"][-4:].tolist())))
            seen[key] += 1
    rows = []
    for key, stats in out.items():
        # the same layer's stage in consecutive steps: are its last 4 finishers the same SMs / workers?
        at = {(st, j): (sm, wk) for st, j, sm, wk in last_sets[key]}
        pairs = [(len(sm & at[(st + 1, j)][0]) / 4, len(wk & at[(st + 1, j)][1]) / 4)
                 for (st, j), (sm, wk) in at.items() if (st + 1, j) in at]
        row = {"stage": " → ".join(key[:3]), "prev_tasks": key[3], "tasks": key[4], "stages": len(stats["spread"])}
        row.update({k: round(float(np.median(v)), 2) for k, v in stats.items()})
        row["same_last4_sms_next_step"] = round(float(np.mean([p[0] for p in pairs])), 2) if pairs else None
        row["same_last4_workers_next_step"] = round(float(np.mean([p[1] for p in pairs])), 2) if pairs else None
        rows.append(row)
    return rows


def sm_bias(rec: np.ndarray, min_tasks: int = 96) -> dict:
    """Is an SM systematically slow? Per SM, its tasks' mean duration relative to their stage's
    median, over all stages of ≥ min_tasks tasks; returns the spread of that bias and its
    correlation between the first and second half of the steps."""
    r = rec[rec["op"] >= 0]
    rel = defaultdict(lambda: [[], []])
    steps = np.unique(r["step"])
    half = steps[len(steps) // 2]
    for s in steps:
        rs = r[r["step"] == s]
        for op in np.unique(rs["op"]):
            x = rs[rs["op"] == op]
            if len(x) < min_tasks:
                continue
            d = (x["end"] - x["start"]).astype(float)
            med = np.median(d)
            for sm, v in zip(x["sm"], d / med):
                rel[int(sm)][0 if s < half else 1].append(v)
    sms = sorted(k for k, v in rel.items() if v[0] and v[1])
    a = np.array([np.mean(rel[k][0]) for k in sms])
    b = np.array([np.mean(rel[k][1]) for k in sms])
    return {"sms": len(sms), "bias_p10": round(float(np.percentile(a, 10)), 3),
            "bias_p90": round(float(np.percentile(a, 90)), 3),
            "halves_corr": round(float(np.corrcoef(a, b)[0, 1]), 3) if len(sms) > 2 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--options", type=json.loads, default={})
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    require_cuda("stage_tails.py")
    for name in args.models:
        for batch in args.batches:
            rec, kinds = records(name, batch, args.position, args.page_size, args.steps, args.options)
            if args.out_dir:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                np.savez_compressed(args.out_dir / f"{name}-b{batch}.npz", rec=rec, kinds=np.array(kinds))
            print(json.dumps({"model": name, "batch": batch, "sm_bias": sm_bias(rec)}), flush=True)
            for row in analyse(rec, kinds):
                print(json.dumps({"model": name, "batch": batch, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
