"""The benchmark scripts' command lines refuse bad arguments when they are read, naming the value
and what was expected (not after minutes of tracing, nor as a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str, env_cache: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"MPK_CACHE_DIR": str(env_cache)} if env_cache is not None else None
    return subprocess.run([sys.executable, str(_BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("script", ["prebuild_decode.py", "decode_latency.py"])
@pytest.mark.parametrize("options,message", [
    ('{"nvcc_flags": ["-DX"]}', "\"nvcc_flags\" is ['-DX']; expected one string of flags"),
    ('{"fuse_norm": true}', "unknown mpk option(s) ['fuse_norm']"),
    ('{"num_workers": 0}', "num_workers=0; expected a positive int"),
    ("[1]", "expected a JSON object"),
])
def test_bad_build_options_are_refused_before_any_work(script, options, message):
    res = _run(script, "--options", "{}", options)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_prebuild_help_shows_the_defaults():
    res = _run("prebuild_decode.py", "--help")
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "(default: [1, 4, 16])" in text and "(default: 64)" in text and "(default: 16)" in text


def test_code_size_names_a_missing_cubin_and_an_empty_cache(tmp_path):
    res = _run("code_size.py", str(tmp_path / "nope.cubin"))
    assert res.returncode == 2 and "nope.cubin: no such file" in res.stderr
    res = _run("code_size.py", env_cache=tmp_path)
    assert res.returncode == 2 and f"no cubin given and none in {tmp_path}" in res.stderr


def test_ncu_report_names_a_missing_run_and_the_runs_there(tmp_path):
    (tmp_path / "qwen3-1.7b-b4-sass.csv").write_text("")
    res = _run("ncu_stalls.py", "report", str(tmp_path / "llama3.2-1b-b1"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "llama3.2-1b-b1-sass.csv" in res.stderr and "runs there: qwen3-1.7b-b4" in res.stderr


def test_sampling_latency_parses_and_refuses_bad_arguments():
    res = _run("sampling_latency.py", "--help")
    assert res.returncode == 0 and "--out" in res.stdout
    assert "(default: [1, 16, 64])" in " ".join(res.stdout.split())
    res = _run("sampling_latency.py", "--vocab", "1001")
    assert res.returncode == 2 and "--vocab 1001; expected a multiple of 8" in res.stderr
    res = _run("sampling_latency.py", "--iters", "5")
    assert res.returncode == 2 and "'5': expected an integer >= 20" in res.stderr and "Traceback" not in res.stderr


def test_generate_throughput_parses_and_refuses_bad_arguments():
    res = _run("generate_throughput.py", "--help")
    assert res.returncode == 0 and "--prebuild" in res.stdout and "--skip-peers" in res.stdout
    text = " ".join(res.stdout.split())
    assert "(default: [1, 4, 16, 64])" in text and "(default: 1024)" in text and "(default: 64)" in text
    res = _run("generate_throughput.py", "--concurrency", "0")
    assert res.returncode == 2 and "'0'" in res.stderr and "Traceback" not in res.stderr
    res = _run("generate_throughput.py", "--models", "gpt5")
    assert res.returncode == 2 and "gpt5" in res.stderr and "Traceback" not in res.stderr
