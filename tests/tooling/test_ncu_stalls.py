"""benchmarks/ncu_stalls.py: Nsight Compute's SASS page read back, and its samples attributed to
the functions of a cubin nvcc built here (no GPU, no ncu: the CSV is written as ncu writes it)."""

from __future__ import annotations

import csv
import importlib.util
import pathlib
import random
import shutil
import subprocess
import sys

import pytest

from mpk.executors import build

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_stalls.py"
_spec = importlib.util.spec_from_file_location("ncu_stalls", _PATH)
ncu_stalls = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("ncu_stalls", ncu_stalls)  # dataclasses resolves the module by name
_spec.loader.exec_module(ncu_stalls)

_SOURCE = r"""
__device__ __noinline__ float first(const float* x, int i) { return x[i] * 2.f + 1.f; }
__device__ __noinline__ float second(const float* x, int i) { return x[i] * x[i + 1] - 3.f; }
extern "C" __global__ void kernel(const float* x, float* y) {
  const int i = threadIdx.x;
  y[i] = first(x, i) + second(x, i);
}
"""

_HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
         "Instructions Executed", "stall_long_sb", "stall_barrier", "stall_wait"]


def _write_sass(path: pathlib.Path, rows: list[tuple[int, str, int, int, dict]]) -> None:
    """A SASS page as ``ncu --page source --csv --print-source sass`` writes it: the kernel's
    name, the header, then (address, sass, samples, executed, stalls) per instruction."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "kernel", ""])
        w.writerow(_HEAD)
        for addr, sass, samples, executed, stalls in rows:
            w.writerow([hex(addr), f"      {sass}", samples, samples, executed,
                        stalls.get("long_sb", 0), stalls.get("barrier", 0), stalls.get("wait", "-")])


def test_read_sass_offsets_samples_and_reasons(tmp_path):
    base = 0x7F00_1D40_0000
    rows = [(base + 16 * i, f"NOP {i}", random.randint(0, 50), random.randint(1, 9999),
             {"long_sb": random.randint(0, 9), "barrier": random.randint(0, 9)}) for i in range(40)]
    _write_sass(tmp_path / "x-sass.csv", rows)
    got = ncu_stalls.read_sass(tmp_path / "x-sass.csv")
    assert [i.offset for i in got] == [16 * i for i in range(40)]
    assert [(i.sass, i.samples, i.executed) for i in got] == [(r[1], r[2], r[3]) for r in rows]
    assert [i.stalls["long_sb"] for i in got] == [r[4]["long_sb"] for r in rows]
    assert all(i.stalls["wait"] == 0 for i in got)  # "-" (no data) reads as 0


def test_parse_line_table():
    text = """
        .text.kernel:
        //## File "/src/a/persistent.cuh", line 547
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        //## File "/tmp/x/linalg.cuh", line 12
        /*0020*/                   EXIT ;
    """
    assert ncu_stalls.parse_line_table(text) == {0: "persistent.cuh:547", 0x10: "persistent.cuh:547", 0x20: "linalg.cuh:12"}


@pytest.mark.skipif(build.nvcc_path() is None or shutil.which("readelf") is None or shutil.which("c++filt") is None,
                    reason="needs nvcc, readelf and c++filt")
def test_report_attributes_samples_to_the_innermost_function(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(_SOURCE)
    cubin = tmp_path / "x-cubin"
    subprocess.run([build.nvcc_path(), "-cubin", "-lineinfo", "-O3", "-arch=sm_90a", "-o", str(cubin), str(src)],
                   check=True, capture_output=True)
    code = ncu_stalls.read_code(cubin)
    names = {name for _, _, name in code.funcs}
    assert {"kernel", "first", "second"} <= names, names
    spans = {name: (lo, hi) for lo, hi, name in code.funcs}
    # an offset inside a callee counts for it, not for the kernel whose symbol may span it too
    picks = {name: random.randrange(lo, hi) // 16 * 16 for name, (lo, hi) in spans.items() if name in ("first", "second")}
    samples = {"first": random.randint(100, 200), "second": random.randint(300, 400)}
    base = 0x7F55_0000_0000
    end = max(hi for lo, hi in spans.values())
    rows = []
    for off in range(0, end, 16):
        owner = next((n for n, o in picks.items() if o == off), None)
        rows.append((base + off, "NOP", samples[owner] if owner else 0, 1, {"long_sb": samples[owner] if owner else 0}))
    _write_sass(tmp_path / "x-sass.csv", rows)
    text = ncu_stalls.report(tmp_path / "x-sass.csv", cubin, top=5)
    total = sum(samples.values())
    assert f"{total} warp samples" in text
    by_function = text.split("by function")[1].split("by source line")[0]
    for name, n in samples.items():
        assert any(line.split()[0] == str(n) and line.split()[2] == name for line in by_function.splitlines()[2:]), \
            (name, by_function)
    if ncu_stalls.nvdisasm_path() is not None:  # the line table: every sampled instruction has a source line
        assert all(code.lines.get(off, "?").startswith("k.cu:") for off in picks.values()), code.lines
