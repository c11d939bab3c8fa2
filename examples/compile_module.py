"""Compile an ordinary PyTorch module with ``torch.compile(backend="mpk")``, check it against
eager, print the task-graph summary and where the dump (tables, DOT/SVG, JSON) and, on a GPU,
the in-kernel profiler's trace (Chrome/Perfetto JSON, and its timeline as an SVG) were written.

    python examples/compile_module.py [--layers 2] [--out mpk-example]

With CUDA it runs as one persistent kernel; without, on the CPU reference interpreter, which
executes the same tables.
"""

from __future__ import annotations

import argparse
import time

import torch

from mpk.backend import COMPILED
from mpk.cli import count
from mpk.testing.toy_models import QWEN3, Decoder, randomize, rope_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=count(1), default=2)
    parser.add_argument("--seq", type=count(1), default=6)
    parser.add_argument("--out", default="mpk-example", help="debug dump directory")
    ns = parser.parse_args()

    from dataclasses import replace

    cfg = replace(QWEN3, layers=ns.layers)
    gen = torch.Generator().manual_seed(0)
    model = randomize(Decoder(cfg), gen).eval()
    ids = torch.randint(0, cfg.vocab, (2, ns.seq), generator=gen)
    cos, sin = rope_tables(cfg, torch.arange(ns.seq))

    gpu = torch.cuda.is_available()
    options = {"executor": "gpu" if gpu else "cpu", "debug_dir": ns.out}
    if gpu:
        model, ids, cos, sin = model.cuda(), ids.cuda(), cos.cuda(), sin.cuda()
        options["profile_dir"] = ns.out
    else:
        options["num_workers"] = 32
    compiled = torch.compile(model, backend="mpk", options=options)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = compiled(ids, cos, sin)
        elapsed = time.perf_counter() - t0
        ref = model(ids, cos, sin)
    err = float((out - ref).abs().max() / ref.abs().max())
    print(f"executor: {options['executor']}")
    print(COMPILED[-1].stats.summary())
    print(f"\nlogits {tuple(out.shape)}: max relative error vs eager {err:.2e} "
          f"({'OK' if err <= 1e-5 else 'MISMATCH'}); compile + first run {elapsed:.2f} s")
    print(f"dump: {ns.out}/graph0.{{summary.txt,opgraph.txt,tables,json,dot}} (+ .svg with graphviz)")
    if gpu:
        from mpk.executors.timeline import timeline_svg

        timeline_svg(f"{ns.out}/trace0.json", f"{ns.out}/trace0.svg", title="compile_module.py: one launch")
        print(f"profiler trace (open in ui.perfetto.dev or chrome://tracing): {ns.out}/trace0.json, "
              f"drawn (a lane per SM): {ns.out}/trace0.svg")
    if err > 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
