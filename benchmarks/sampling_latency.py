"""Sampling latency: ``torch.ops.mpk.sample`` compiled by mpk (one persistent-kernel launch: a
sample_partial and a sample_digit task per (row, segment), then a sample task per row:
cuda/mpk_tasks/sampling.cuh) against torch's sort-based filtering
(``mpk.engine.sampling.sample`` on CUDA tensors) and ``torch.topk`` + ``torch.multinomial``.

For each batch size and parameter mix (greedy, top-k 50, top-p 0.9, top-k 50 + top-p 0.9) on
random bf16 logits of ``--vocab`` entries (Qwen3's 151,936): the median over ``--iters`` calls
(CUDA events, after warm-up) of each. mpk's graphs launch asynchronously (``sync=False``, as
decode_latency.py times its steps), so the events measure GPU time per launch, not the host's
synchronisation. The same run times the launch floor, an mpk graph of one trivial task launched
the same way, so the sampling ops' own time reads as ``mpk_us − floor_us``. Prints one JSON
line per configuration (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import require_cuda, time_step  # noqa: E402

from mpk.cli import count  # noqa: E402

MIXES = {  # temperature, top_k, top_p
    "greedy": (0.0, 0, 1.0),
    "top_k50": (1.0, 50, 1.0),
    "top_p0.9": (1.0, 0, 0.9),
    "top_k50_top_p0.9": (1.0, 50, 0.9),
}


# asynchronous launches: a synchronising call's events would time the host's wait as well
_GPU = {"executor": "gpu", "sync": False}


def _mpk():
    return torch.compile(lambda *a: torch.ops.mpk.sample(*a), backend="mpk", fullgraph=True, dynamic=False,
                         options=_GPU)


def launch_floor_us(warmup: int, iters: int) -> float:
    """Median µs of an mpk graph of one trivial task (x + 1 on one element): the launch floor."""
    fn = torch.compile(lambda x: x + 1, backend="mpk", fullgraph=True, dynamic=False, options=_GPU)
    x = torch.zeros(1, device="cuda")
    return 1e3 * time_step(lambda: fn(x), warmup, iters)


def topk_multinomial(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The common eager recipe: top-k of the tempered logits, softmax, multinomial (top-k only)."""
    vals, idx = torch.topk(logits.float() / temperature, top_k, dim=-1)
    return idx.gather(-1, torch.multinomial(torch.softmax(vals, dim=-1), 1)).squeeze(-1)


def bench(batch: int, vocab: int, mix: str, warmup: int, iters: int) -> dict:
    """µs of the mpk graph, torch's sort-based reference and topk + multinomial for one case."""
    from mpk.engine.sampling import sample

    t, k, p = MIXES[mix]
    logits = torch.randn(batch, vocab, device="cuda").bfloat16()
    cols = [torch.full((batch,), v, dtype=d, device="cuda")
            for v, d in ((t, torch.float32), (k, torch.int32), (p, torch.float32), (0.0, torch.float32))]
    seed = torch.randint(0, 1 << 62, (batch,), device="cuda")
    counter = torch.arange(batch, device="cuda")
    fn = _mpk()
    args = (logits, *cols, seed, counter)
    fn(*args)  # trace, compile, build before the timing
    torch.cuda.synchronize()
    row = {"batch": batch, "vocab": vocab, "mix": mix, "mpk_us": 1e3 * time_step(lambda: fn(*args), warmup, iters)}
    seeds, counters = seed.tolist(), counter.tolist()
    row["torch_sort_us"] = 1e3 * time_step(lambda: sample(logits, *cols, seeds, counters), warmup, iters)
    row["topk_multinomial_us"] = (1e3 * time_step(lambda: topk_multinomial(logits, t, k), warmup, iters)
                                  if t > 0 and k > 0 and p >= 1 else None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=count(1), default=[1, 16, 64], help="rows of logits")
    ap.add_argument("--vocab", type=count(8), default=151_936, help="logits per row (a multiple of 8: bf16 words)")
    ap.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES), help="parameter mixes")
    ap.add_argument("--warmup", type=count(0), default=5, help="untimed calls first")
    ap.add_argument("--iters", type=count(20), default=50, help="timed calls (the median is reported)")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    if args.vocab % 8:
        ap.error(f"--vocab {args.vocab}; expected a multiple of 8 (the task reads bf16 rows in 16-byte words)")
    require_cuda("sampling_latency.py")
    device = torch.cuda.get_device_name()
    floor = launch_floor_us(args.warmup, args.iters)
    print(f"device {device}; mpk launch floor {floor:.1f} µs", flush=True)
    rows = []
    for batch in args.batches:
        for mix in args.mixes:
            row = {"date": datetime.date.today().isoformat(), "device": device, "floor_us": floor,
                   **bench(batch, args.vocab, mix, args.warmup, args.iters)}
            row["task_us"] = row["mpk_us"] - floor
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{'batch':>5} {'mix':>18} {'mpk µs':>8} {'task µs':>8} {'torch sort µs':>13} {'topk+multi µs':>13}")
    for r in rows:
        tm = f"{r['topk_multinomial_us']:.1f}" if r["topk_multinomial_us"] is not None else "-"
        print(f"{r['batch']:>5} {r['mix']:>18} {r['mpk_us']:>8.1f} {r['task_us']:>8.1f} {r['torch_sort_us']:>13.1f} "
              f"{tm:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
