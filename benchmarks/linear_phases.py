"""Where a decode step's linear and attention tasks spend their time, phase by phase (the
in-kernel profiler only sees a task's start and end).

Builds the decode step with ``-DMPK_PHASES`` (cuda/mpk_tasks/common.cuh: PhaseTimer), runs
``--steps`` steps and prints, per linear instantiation (form × weight blocks per pass), the
mean nanoseconds per task of: the code before the gate (its first weight loads issued:
``pre_gate``), the gate's wait and the prologue (until the first pass starts: ``setup``), and summed over
the task's passes the K loop (weights streamed, MMAs), partial sums into shared memory, the
epilogue and the closing barrier; for the paged attention tasks (paged_attention.cuh), from
their gate: the first K/V copies issued (the page table is read before the gate), the
rotations (fused rope), the position loop (its first wait for K/V apart: ``kv_wait``), the
warps' states combined and stored; with ``--warm-rerun`` each attention task runs twice and the
second run, its code and data warm, is reported as ``attention warm``. Phase times are thread
0's view.

    python benchmarks/linear_phases.py --models llama3.2-1b --batches 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import compile_step, max_len, random_model  # noqa: E402
from peer import require_cuda  # noqa: E402

from mpk.backend import COMPILED, RUNNERS  # noqa: E402
from mpk.executors import cuda_driver as drv  # noqa: E402
from mpk.llm import SHAPES  # noqa: E402

# linalg.cuh: linear_phase_slot (slot = index here · len(BLOCKS) + block index); the forms as
# mpk.ops.linalg.form_name calls them
FORMS = ("matmul", "rms_norm_matmul", "matmul_silu_mul", "rms_norm_matmul_silu_mul", "matmul_norm_stats",
         "norm_stats_matmul", "norm_stats_matmul_silu_mul")
BLOCKS = (2, 3, 4, 6, 8)
PHASES = ("setup", "k_loop", "to_shared", "epilogue", "barrier", "pre_gate")  # linalg.cuh: linear_bf16's marks
ATTN_SLOT, ATTN_WARM_SLOT = 35, 36  # common.cuh: kAttnPhaseSlot, kAttnWarmSlot
ATTN_PHASES = ("issue", "rope", "loop", "combine", "kv_wait")  # paged_attention.cuh: attn_partial_impl's marks
SLOTS, NUM_PHASES = 40, 8  # common.cuh: kPhaseSlots, kPhases


def phases(model_name: str, batch: int, position: int, steps: int, options: dict | None = None) -> list[dict]:
    model = random_model(SHAPES[model_name], max_len(position))  # decode_latency's step (prebuild_decode.py builds it)
    step, kv = compile_step(model, batch, position, 16, {**(options or {}), "nvcc_flags": os.environ["MPK_NVCC_FLAGS"]})
    tokens = torch.randint(0, model.cfg.vocab, (batch,), device="cuda")
    with torch.no_grad():
        step(tokens, *kv.args())  # compile, build, warm up
        ex = RUNNERS[id(COMPILED[-1])].state["ex"]
        ptr, nbytes = ex.module.global_ptr("mpk_phase_ns")
        acc = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        drv.memset_d32_async(ptr, 0, nbytes // 4, stream)
        for _ in range(steps):
            step(tokens, *kv.args())
        drv.copy_device_async(acc.data_ptr(), ptr, nbytes, stream)
        torch.cuda.synchronize()
    table = acc.cpu().numpy().reshape(-1, SLOTS, NUM_PHASES).sum(0)
    rows = []
    for slot in range(len(FORMS) * len(BLOCKS)):
        tasks = int(table[slot, NUM_PHASES - 1])
        if tasks and slot != ATTN_SLOT:
            per = table[slot, : len(PHASES)] / tasks
            rows.append({"form": FORMS[slot // len(BLOCKS)], "blocks": BLOCKS[slot % len(BLOCKS)], "tasks_per_step": tasks // steps,
                         **{f"{p}_us": round(float(v) / 1e3, 3) for p, v in zip(PHASES, per)},
                         "total_us": round(float(per.sum()) / 1e3, 3)})
    for slot, form in ((ATTN_SLOT, "attention"), (ATTN_WARM_SLOT, "attention warm")):
        tasks = int(table[slot, NUM_PHASES - 1])
        if tasks:
            per = table[slot, : len(ATTN_PHASES)] / tasks
            rows.append({"form": form, "blocks": 0, "tasks_per_step": tasks // steps,
                         **{f"{p}_us": round(float(v) / 1e3, 3) for p, v in zip(ATTN_PHASES, per)},
                         "total_us": round(float(per.sum()) / 1e3, 3)})
    del step
    torch._dynamo.reset()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b"], choices=sorted(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--position", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--options", type=json.loads, default={}, help="mpk compile options (JSON) of the step")
    ap.add_argument("--warm-rerun", action="store_true",
                    help="run each attention task twice (-DMPK_ATTN_WARM_RERUN) and report the second run, its "
                         "code and data warm, as 'attention warm' (a diagnostic: the step does the work twice)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    require_cuda("linear_phases.py")
    flags = os.environ.get("MPK_NVCC_FLAGS", "")
    for flag in ["-DMPK_PHASES"] + (["-DMPK_ATTN_WARM_RERUN"] if args.warm_rerun else []):
        if flag not in flags.split():
            flags = (flags + " " + flag).strip()
    os.environ["MPK_NVCC_FLAGS"] = flags
    device = torch.cuda.get_device_name()
    print(f"{'model':12s} {'B':>3s} {'form':14s} {'blocks':>6s} {'tasks':>6s} "
          + " ".join(f"{p:>9s}" for p in PHASES) + f" {'total µs':>9s}")
    for name in args.models:
        for batch in args.batches:
            for row in phases(name, batch, args.position, args.steps, args.options):
                names = ATTN_PHASES if row["form"].startswith("attention") else PHASES
                print(f"{name:12s} {batch:3d} {row['form']:14s} {row['blocks']:6d} {row['tasks_per_step']:6d} "
                      + " ".join(f"{p[:4]}={row[p + '_us']:<6.2f}"[:9].rjust(9) for p in names)
                      + f" {row['total_us']:9.2f}", flush=True)
                if args.out:
                    rec = {"date": datetime.date.today().isoformat(), "device": device, "model": name, "batch": batch,
                           "position": args.position, "nvcc_flags": flags, **row}
                    with args.out.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
