"""Scale: compiler steps 1–7 for a Qwen3-8B-shaped decode step (36 layers, batch 1, a
1024-entry static cache) on the CI machine, within 10 s. Tracing (torch.export on meta tensors)
is not part of the bound and is timed separately."""

from __future__ import annotations

import time

import pytest

from mpk.cli import PRESETS

STEPS = ("decompose", "depend", "prune", "fuse", "normalize", "linearize", "modes", "place", "emit")


@pytest.mark.slow
def test_qwen3_8b_decode_step_compiles_within_bound(capsys):
    import argparse

    from mpk.inspection import compile_module

    ns = argparse.Namespace(layers=None, batch=1, seq=1, cache_len=1024)
    model, args = PRESETS["qwen3-8b-decode"](ns)
    t0 = time.perf_counter()
    compiled = compile_module(model, args, {"num_workers": 128})
    total = time.perf_counter() - t0
    s = compiled.stats
    steps = sum(s.seconds[k] for k in STEPS)
    print(f"\nqwen3-8b decode: {s.num_tasks} tasks, {s.num_edges} edges, steps 1-7 {steps:.2f} s, "
          f"trace+compile {total:.1f} s")
    assert steps <= 10.0
    assert s.num_tasks > 36 * 500  # a real task graph, not a stub: hundreds of tasks per layer
    n_ops = len(compiled.graph.ops)
    assert n_ops > 36 * 10
    assert s.num_jit_tasks == sum(t for name, t in s.tasks_per_op.items() if name.startswith("attention"))
    assert s.dummy_share < 0.05
