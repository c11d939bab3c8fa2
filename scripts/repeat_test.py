"""Run one parametrised test case many times in one process (reseeding Python's and
torch's generators before each) and report every failure with its seed: for chasing intermittent GPU failures.

    python3 scripts/repeat_test.py tests/gpu/test_gpu_decode.py test_compiled_decode_matches_eager \
        '["qwen3", 16, 1, {}, {}, 0]' --times 30
"""
import argparse
import importlib.util
import json
import random
import sys
import traceback
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("test")
    ap.add_argument("args", help="the case's arguments as a JSON list")
    ap.add_argument("--times", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0)
    a = ap.parse_args()
    sys.path.insert(0, str(a.file.parent))
    spec = importlib.util.spec_from_file_location(a.file.stem, a.file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn, args = getattr(mod, a.test), json.loads(a.args)
    failures = 0
    for seed in range(a.first_seed, a.first_seed + a.times):
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 -- reported, counted, and the exit code says so
            failures += 1
            print(f"seed {seed}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc(limit=-2)
    print(f"{a.test}{args}: {failures} of {a.times} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
