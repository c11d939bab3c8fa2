"""scripts/gpu_ab.sh, on a machine without a GPU: a stand-in benchmark records which mpk it
imported, so the test checks that the baseline runs see the baseline tree's package and the
others the working tree's, alternating, and that the merged file tags every row."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A benchmark: imports mpk and writes one row naming it to --out (fails where FAIL_TREE says).
BENCH = r"""
import argparse, json, os, sys
import mpk
ap = argparse.ArgumentParser()
ap.add_argument("--case")
ap.add_argument("--out")
a = ap.parse_args()
tree = "base" if "baseline" in mpk.__file__ else "new"
if os.environ.get("FAIL_TREE") == tree:
    sys.exit(3)
with open(a.out, "w") as f:
    f.write(json.dumps({"case": a.case, "mpk": mpk.__file__}) + "\n")
print("ran", a.case, tree)
"""


def _run(tmp_path: pathlib.Path, base: pathlib.Path, **env) -> subprocess.CompletedProcess:
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    if not (pathlib.Path(sys.executable).parent / "python3").exists():
        pytest.skip("no python3 beside this interpreter")
    path = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ["PATH"]])
    # the working tree's mpk as CI installs it (editable); PYTHONPATH is the script's to set
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(PATH=path, OUT=str(tmp_path / "out"), BASE=str(base), **env)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_ab.sh"), "ab", str(bench), "--case", "x"],
                          env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _baseline(tmp_path: pathlib.Path) -> pathlib.Path:
    base = tmp_path / "baseline"
    for d in ("mpk", "cuda", "runtime"):
        (base / d).mkdir(parents=True)
    (base / "mpk" / "__init__.py").write_text("")
    return base


def test_ab_alternates_the_baseline_and_the_working_tree(tmp_path):
    res = _run(tmp_path, _baseline(tmp_path), ROUNDS="3")
    if "No module named 'mpk'" in res.stdout + res.stderr:
        pytest.skip("mpk is not installed for python3")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "ab.jsonl").read_text().splitlines()]
    assert [(r["tree"], r["ab_round"]) for r in rows] == [(t, r) for r in range(3) for t in ("base", "new")]
    for r in rows:
        assert r["case"] == "x"
        assert (pathlib.Path(r["mpk"]).parent.parent == tmp_path / "baseline") == (r["tree"] == "base"), r
    assert not list((tmp_path / "out").glob("ab-*-r*.jsonl"))  # parts merged, logs kept
    assert (tmp_path / "out" / "ab-new-r2.log").read_text().startswith("ran x new")


def test_ab_reports_a_failed_run_and_a_missing_baseline(tmp_path):
    res = _run(tmp_path, _baseline(tmp_path), ROUNDS="1", FAIL_TREE="new")
    assert res.returncode == 1 and "new round 0 exited 3" in res.stderr, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "ab.jsonl").read_text().splitlines()]
    assert [r["tree"] for r in rows] == ["base"]
    res = _run(tmp_path, tmp_path / "nowhere")
    assert res.returncode == 2 and "no baseline tree at" in res.stderr, res.stderr
