"""``mpk serve`` as a process: SIGTERM lets an in-flight stream finish, then exits 0; and
``mpk bench serve`` against a server (JSON lines, then a table)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mpk.engine.commands import add_commands

from .conftest import MODEL, free_port, serving

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_an_in_flight_stream_and_exits_0(checkpoint):
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mpk.cli", "serve", "--model", str(checkpoint), "--port", str(port),
                             "--max-model-len", "512", "--max-num-seqs", "4", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage, after_signal = 0, None, 0
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                doc = json.loads(line[6:])
                chunks += 1
                if chunks == 1:
                    proc.send_signal(signal.SIGTERM)
                else:
                    after_signal += 1
                usage = doc["usage"] or usage
        assert usage is not None and usage["completion_tokens"] == 150  # finished after SIGTERM
        assert after_signal > 0
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_serve_prints_json_lines_then_a_table(checkpoint, capsys):
    import argparse

    from mpk.cli import count, page_size

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(), count, page_size)
    with serving(checkpoint) as server:
        ns = parser.parse_args(["bench", "serve", "--url", server.url, "--concurrency", "1", "4", "--num-prompts", "4",
                                "--input-len", "8", "--output-len", "5"])
        assert ns.func(ns) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    docs = [json.loads(line) for line in lines[:2]]
    assert [d["concurrency"] for d in docs] == [1, 4]
    for d in docs:
        assert d["completed"] == 4 and d["failed"] == 0
        assert d["output_tokens_per_s"] > 0 and 0 < d["ttft_p50_ms"] <= d["ttft_p99_ms"] <= d["e2e_p99_ms"]
        assert d["tpot_p50_ms"] > 0
    assert lines[2].split()[0] == "load" and len(lines) == 5  # header, then a row per point
