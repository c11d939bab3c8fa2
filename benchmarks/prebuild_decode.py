"""Build the decode steps' kernels ahead, on a machine with nvcc and no GPU: trace each
(model, batch) step exactly as ``decode_latency.py`` does (same max length, page size,
position and options; weights left uninitialised, which the tables do not depend on),
generate its CUDA and compile all of them in parallel into ``$MPK_CACHE_DIR``. Carried to the
device, that cache lets the benchmark skip nvcc (a cubin is keyed by source, headers, flags
and nvcc's version, so a different nvcc just rebuilds).

    MPK_CACHE_DIR=.mpk-cache python benchmarks/prebuild_decode.py --models llama3.2-1b --batches 1 16 \\
        --options '{}' '{"fuse_norm_prologue": true}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import add_step_args, build_options, compile_step, max_len  # noqa: E402

from mpk.backend import TracedOnly, trace_only  # noqa: E402
from mpk.cli import count  # noqa: E402
from mpk.executors import build  # noqa: E402
from mpk.executors.codegen import generate  # noqa: E402
from mpk.llm import SHAPES, DecoderLM  # noqa: E402


def decode_source(name: str, batch: int, position: int, page_size: int, num_splits: int, options: dict,
                  layers: int | None = None) -> str:
    """The generated CUDA of ``decode_latency.bench_mpk``'s step for this configuration
    (``layers``: the model cut to that many)."""
    cfg = SHAPES[name] if layers is None else replace(SHAPES[name], layers=layers)
    model = DecoderLM(cfg, torch.bfloat16, "cpu", max_len=max_len(position), num_splits=num_splits)
    step, kv = compile_step(model, batch, position, page_size, options)
    try:
        with torch.no_grad(), trace_only():
            step(torch.zeros(batch, dtype=torch.long), *kv.args())
    except TracedOnly as e:  # compiled, not run: the tables are what we came for
        compiled = e.compiled
    else:
        raise RuntimeError(f"{name} batch {batch}: nothing was compiled")
    finally:
        torch._dynamo.reset()
    return generate(compiled.tables)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_step_args(ap)
    ap.add_argument("--options", nargs="+", type=build_options, default=[{}],
                    help="one JSON object per build variant (decode_latency.py's --options)")
    ap.add_argument("--jobs", type=count(1), default=None, help="parallel nvcc processes (None: one per core)")
    ap.add_argument("--nvcc-flags", action="append", default=None,
                    help="repeatable, e.g. --nvcc-flags=-DMPK_PHASES: build every step once per flag set (as "
                         "$MPK_NVCC_FLAGS; default: the environment's) unless its options name their own "
                         "\"nvcc_flags\"")
    ap.add_argument("--tp", type=count(1), default=1,
                    help="tensor-parallel degree: build every rank's shard (decode_latency.py --tp N)")
    args = ap.parse_args(argv)
    if args.tp > 1:
        args.options = [{**o, "tensor_parallel": (r, args.tp)} for o in args.options for r in range(args.tp)]
    env_flags = os.environ.get("MPK_NVCC_FLAGS", "")
    by_flags: dict[str, list[str]] = {}  # an option's own "nvcc_flags" replaces the flag sets
    for name in args.models:
        for batch in args.batches:
            for options in args.options:
                src = decode_source(name, batch, args.position, args.page_size, args.num_splits, options)
                for flags in [options["nvcc_flags"]] if "nvcc_flags" in options else args.nvcc_flags or [env_flags]:
                    by_flags.setdefault(flags, []).append(src)
                print(f"traced {name} batch {batch} {json.dumps(options)}", flush=True)
    for flags, sources in by_flags.items():
        os.environ["MPK_NVCC_FLAGS"] = flags
        start = time.perf_counter()
        paths = build.prebuild(sources, jobs=args.jobs)
        print(f"built {len(paths)} cubins (MPK_NVCC_FLAGS={flags!r}) in {time.perf_counter() - start:.0f} s into "
              f"{build.cache_dir()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
