"""Instruction bytes of each function of built persistent kernels (SASS, via ``cuobjdump``).

Every task family lives in the one persistent kernel, so a task whose code is not in the SM's
instruction cache pays for fetching it; this lists where the code is. Usage:
``python benchmarks/code_size.py [CUBIN ...]`` (default: the newest cubin in ``$MPK_CACHE_DIR``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mpk.executors.build import cache_dir


def function_bytes(cubin: Path) -> dict[str, int]:
    """SASS bytes per function (16 bytes per Hopper instruction)."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump not found (it ships with the CUDA toolkit)")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    sizes: dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            current = m.group(1)
            sizes[current] = 0
        elif current and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            sizes[current] += 16
    return sizes


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cubins", nargs="*", type=Path, metavar="CUBIN",
                    help="built kernels (default: the newest cubin in $MPK_CACHE_DIR)")
    args = ap.parse_args(argv)
    cubins = args.cubins or sorted(cache_dir().glob("*.cubin"), key=lambda p: p.stat().st_mtime)[-1:]
    if not cubins:
        ap.error(f"no cubin given and none in {cache_dir()} ($MPK_CACHE_DIR): build a kernel first")
    for missing in (c for c in cubins if not c.is_file()):
        ap.error(f"{missing}: no such file")
    for cubin in cubins:
        sizes = function_bytes(cubin)
        print(f"{cubin}: {sum(sizes.values()) / 1024:.1f} KiB of instructions")
        names = sorted(sizes, key=lambda n: -sizes[n])
        for name, pretty in zip(names, demangle(names)):
            print(f"  {sizes[name] / 1024:8.1f} KiB  {pretty[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
