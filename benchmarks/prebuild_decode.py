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
import time

import torch

from mpk.backend import COMPILED
from mpk.errors import ExecutorUnavailableError
from mpk.megakernel import build
from mpk.megakernel.codegen import generate
from mpk.models.llm import SHAPES, DecoderLM, PagedKVCache


def decode_source(name: str, batch: int, position: int, page_size: int, num_splits: int, options: dict) -> str:
    """The generated CUDA of ``decode_latency.bench_mpk``'s step for this configuration."""
    model = DecoderLM(SHAPES[name], torch.bfloat16, "cpu", max_len=position + 64, num_splits=num_splits)
    kv = PagedKVCache(model, batch, position + 1, page_size)
    kv.grow(position + 1)
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu", "sync": False, **options})
    COMPILED.clear()
    try:
        with torch.no_grad():
            step(torch.zeros(batch, dtype=torch.long), *kv.args())
    except ExecutorUnavailableError:
        pass  # compiled, then refused to run without CUDA: the tables are what we came for
    if not COMPILED:
        raise RuntimeError(f"{name} batch {batch}: nothing was compiled")
    torch._dynamo.reset()
    return generate(COMPILED[-1].tables)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-1.7b", "qwen3-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--position", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-splits", type=int, default=0)
    ap.add_argument("--options", nargs="+", type=json.loads, default=[{}], help="one JSON object per build variant")
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    sources = []
    for name in args.models:
        for batch in args.batches:
            for options in args.options:
                sources.append(decode_source(name, batch, args.position, args.page_size, args.num_splits, options))
                print(f"traced {name} batch {batch} {json.dumps(options)}", flush=True)
    start = time.perf_counter()
    paths = build.prebuild(sources, jobs=args.jobs)
    print(f"built {len(paths)} cubins in {time.perf_counter() - start:.0f} s into {build.cache_dir()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
