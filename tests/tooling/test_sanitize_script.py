"""scripts/gpu_sanitize.sh's verdict, on a machine without a GPU: a stand-in compute-sanitizer
runs the command it is given and writes the summary line the real tool would, with the counts
the test chooses, so the script's parsing and exit status are checked where CI runs (the GPU
tests it selects skip here)."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Prints a version, runs the command after the options, then writes the tool's summary to
# --log-file: the control's count for scripts/sanitizer_control.py, the sweep's otherwise.
FAKE = r"""#!/usr/bin/env bash
log="" tool=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --version) echo "fake compute-sanitizer"; exit 0 ;;
    --log-file) log=$2; shift 2 ;;
    --tool) tool=$2; shift 2 ;;
    --*) shift 2 ;;
    *) break ;;
  esac
done
"$@"; rc=$?
[[ "$*" == *sanitizer_control* ]] && n=$FAKE_CONTROL || n=$FAKE_ERRORS
if [[ $tool == racecheck ]]; then
  echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)" > "$log"
else
  echo "========= ERROR SUMMARY: $n errors" > "$log"
fi
exit $rc
"""


def _run(tmp_path: pathlib.Path, tools: str, control: int, errors: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    # python3 in the script must be this interpreter (a virtual environment's, say)
    path = os.pathsep.join([str(bin_dir), str(pathlib.Path(sys.executable).parent), os.environ["PATH"]])
    if not (pathlib.Path(sys.executable).parent / "python3").exists():
        pytest.skip("no python3 beside this interpreter")
    env = {**os.environ, "PATH": path, "TOOLS": tools, "JOBS": "0", "OUT": str(tmp_path / "out"),
           "FAKE_CONTROL": str(control), "FAKE_ERRORS": str(errors),
           "MEMCHECK_K": "rebinding", "SYNCCHECK_K": "rebinding", "RACECHECK_K": "rebinding"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_sanitize.sh")], env=env, capture_output=True,
                          text=True, timeout=300)


def _row(out: str, tool: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if re.match(rf"{tool} +\|", ln))
    return [c.strip() for c in line.split("|")]


def test_clean_sweep_passes_and_reports_each_tool(tmp_path):
    res = _run(tmp_path, "memcheck racecheck", control=32, errors=0)
    assert res.returncode == 0, res.stdout + res.stderr
    for tool in ("memcheck", "racecheck"):
        row = _row(res.stdout, tool)
        assert row[1:3] == ["32", "0"], row
        assert re.search(r"\b1 (passed|skipped)", row[4]), row  # the selected GPU test (skips without CUDA)


@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "racecheck"])
def test_errors_in_the_tests_fail_the_sweep(tmp_path, tool):
    res = _run(tmp_path, tool, control=1, errors=3)
    assert res.returncode == 1, res.stdout + res.stderr
    assert _row(res.stdout, tool)[1:3] == ["1", "3"]


def test_a_control_the_tool_did_not_report_fails_the_sweep(tmp_path):
    res = _run(tmp_path, "synccheck", control=0, errors=0)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "synccheck did not report its planted bug" in res.stdout
    assert _row(res.stdout, "synccheck")[1:3] == ["0", "0"]


def test_an_unknown_tool_is_refused_before_anything_runs(tmp_path):
    res = _run(tmp_path, "memcheck initcheck", control=1, errors=0)
    assert res.returncode == 2
    assert "TOOLS: initcheck? expected memcheck, synccheck or racecheck" in res.stdout
    assert not (tmp_path / "out" / "pytest-memcheck.log").exists()
