"""scripts/gpu_suite.sh and scripts/gpu_decode.sh's exit status, on a machine without a GPU:
stand-in python3 and nvidia-smi commands exit with the status the test chooses, so a failed
test or benchmark run is seen to fail the script (both had ended with status 0 whatever ran)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path, script: str, env: dict, python_rc: int) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    shutil.copy(ROOT / "scripts" / "gpu_decode.sh", tmp_path / "scripts" / "gpu_decode.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("python3", f"exit {python_rc}"), ("nvidia-smi", "echo stand-in GPU")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return subprocess.run(["bash", str(tmp_path / "scripts" / script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "OUT": str(tmp_path / "out")})


@pytest.mark.parametrize("script,env", [("gpu_suite.sh", {"PARTS": "runtime"}), ("gpu_suite.sh", {"PARTS": "bench"}),
                                        ("gpu_decode.sh", {"STAGE": "tests"}), ("gpu_decode.sh", {"STAGE": "latency"})])
def test_a_failure_fails_the_script(tmp_path, script, env):
    assert _run(tmp_path, script, env, python_rc=1).returncode != 0
    assert _run(tmp_path, script, env, python_rc=0).returncode == 0


def test_a_part_with_no_tests_selected_passes(tmp_path):
    """pytest's status 5 (no tests collected: PYTEST_ARGS narrowed a part to nothing) is not a
    failure."""
    assert _run(tmp_path, "gpu_suite.sh", {"PARTS": "runtime"}, python_rc=5).returncode == 0


@pytest.mark.parametrize("script,env,message", [
    ("gpu_suite.sh", {"PARTS": "runtime decod"}, "PARTS has decod; expected decode, parity, breadth, runtime, bench"),
    ("gpu_decode.sh", {"STAGE": "latnecy"}, "STAGE=latnecy; expected tests, bandwidth, latency, phases or all"),
])
def test_a_misspelt_part_is_named(tmp_path, script, env, message):
    done = _run(tmp_path, script, env, python_rc=0)
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()
