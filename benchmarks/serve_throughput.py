"""``mpk serve`` under load beside the engine's offline throughput, on one device in one run
(random weights of a model's shape).

Writes a checkpoint of the shape (random bf16 weights, the byte tokenizer padded to the model's
vocabulary: ``mpk.testing.engine.tiny_checkpoint``), starts ``mpk serve`` on 127.0.0.1 as a
subprocess, and runs ``mpk bench serve``'s sweep against it: per concurrency c, ``--waves`` × c
streamed completions of ``--input-len`` random tokens and ``--output-len`` tokens each, c in
flight at once (TTFT, TPOT, end-to-end p50/p99, output tokens/s). Then the server is stopped
(SIGTERM) and the same engine (same options, hence the same kernels) runs the same load
offline in this process: ``--waves`` rounds of ``LLM.generate`` over c prompts. The server's
overhead at c is 1 − served tokens/s ÷ offline tokens/s (target ≤ 5% at 64 streams).

``--tensor-parallel-size N`` serves (and runs offline) over N GPUs. ``--kill-rank R`` instead
tests a rank's death under load: ``--kill-after`` seconds into the largest concurrency's
streams, rank R's worker process is killed (SIGKILL); the row records how long every other
worker took to exit, what /health and a new completion answered (503 expected), how many
streams failed, and whether the server's log names the dead rank (target: all within 30 s,
nothing hangs).

``--prebuild`` traces the engine's graphs (every rank's shard under ``--tensor-parallel-size``) on
(uninitialised) CPU weights and builds their kernels into
``$MPK_CACHE_DIR`` (no GPU needed): the server and the offline engine then skip nvcc. Prints one
JSON line per concurrency (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row  # noqa: E402

from mpk import LLM, SamplingParams  # noqa: E402
from mpk.cli import count  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402
from mpk.llm import DecoderLM  # noqa: E402
from mpk.serve.bench import sweep  # noqa: E402

HEALTH_TIMEOUT_S = 300


def engine_options(args) -> dict:
    """The server's and the offline engine's options: equal, so both run the same kernels (the
    page pool is fixed: its size is part of the graphs)."""
    max_len = args.input_len + args.output_len
    seqs = max(args.concurrency)
    return dict(max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                page_size=16, num_pages=seqs * -(-max_len // 16), executor="gpu",
                tensor_parallel_size=args.tensor_parallel_size)


def prebuild(args) -> None:
    """Trace the engine's graphs (every rank's shard under --tensor-parallel-size) and build
    their kernels."""
    model = DecoderLM(args.cfg, torch.bfloat16, "cpu", max_len=args.input_len + args.output_len)
    options = engine_options(args)
    world = options.pop("tensor_parallel_size")
    if world == 1:
        print(LLM.from_model(model, **options).compile(progress=True), flush=True)
        return
    from mpk.engine.runner import ModelRunner

    options.pop("executor")
    for rank in range(world):
        torch._dynamo.reset()  # each rank's graphs are new entries for the model's forward
        runner = ModelRunner(model, executor="gpu", tensor_parallel=(rank, world), **options)
        print(f"rank {rank} of {world}:", runner.compile(progress=True), flush=True)


def serve(ckpt: Path, args, log=None) -> subprocess.Popen:
    """``mpk serve`` started and answering /health (``log``: a file for its stderr and its workers')."""
    o = engine_options(args)
    cmd = [sys.executable, "-m", "mpk.cli", "serve", "--model", str(ckpt), "--port", str(args.port),
           "--max-num-seqs", str(o["max_num_seqs"]), "--max-model-len", str(o["max_model_len"]),
           "--max-num-batched-tokens", str(o["max_num_batched_tokens"]), "--num-pages", str(o["num_pages"]),
           "--page-size", str(o["page_size"]), "--max-queue", str(args.waves * max(args.concurrency)),
           "--tensor-parallel-size", str(args.tensor_parallel_size), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=log)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mpk serve exited with {proc.returncode} before answering /health")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"mpk serve did not answer /health within {HEALTH_TIMEOUT_S} s")


def served(args) -> dict[int, dict]:
    """The sweep's row per concurrency (mpk.serve.bench)."""
    rows = {}
    for c in args.concurrency:
        ns = argparse.Namespace(url=f"http://127.0.0.1:{args.port}", api_key=None, seed=c, rates=None,
                                concurrency=[c], num_prompts=args.waves * c, input_len=args.input_len,
                                output_len=args.output_len)
        rows[c] = asyncio.run(sweep(ns))[0]
    return rows


def workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """The server's worker ranks by rank (``python -m mpk.distributed.worker`` children)."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "mpk.distributed.worker" in " ".join(child.cmdline()):
                found[int(child.environ()["RANK"])] = child
        except (psutil.NoSuchProcess, KeyError):
            pass
    return found


def kill_under_load(ckpt: Path, args, log_path: Path) -> dict:
    """Serve ``max(concurrency)`` streams, kill rank ``args.kill_rank`` mid-load, and time what follows."""
    c = max(args.concurrency)
    ns = argparse.Namespace(url=f"http://127.0.0.1:{args.port}", api_key=None, seed=c, rates=None, concurrency=[c],
                            num_prompts=c, input_len=args.input_len, output_len=args.output_len)
    with log_path.open("w") as log:
        proc = serve(ckpt, args, log)
        try:
            ranks = workers(proc)
            if args.kill_rank not in ranks:
                raise RuntimeError(f"--kill-rank {args.kill_rank}: the server's workers are ranks {sorted(ranks)}")
            result: dict = {}
            load = threading.Thread(target=lambda: result.update(asyncio.run(sweep(ns))[0]), daemon=True)
            load.start()
            time.sleep(args.kill_after)
            victim = ranks.pop(args.kill_rank)
            victim.kill()
            killed = time.monotonic()
            _, alive = psutil.wait_procs(list(ranks.values()), timeout=60)
            exited_s = time.monotonic() - killed if not alive else None
            # rank 0 learns of the death from its monitor (about a second): /health until it says so
            while (health := httpx.get(f"{ns.url}/health", timeout=10)).status_code == 200 \
                    and time.monotonic() - killed < 30:
                time.sleep(0.2)
            unhealthy_s = time.monotonic() - killed
            name = httpx.get(f"{ns.url}/v1/models", timeout=10).json()["data"][0]["id"]
            late = httpx.post(f"{ns.url}/v1/completions", timeout=30,
                              json={"model": name, "prompt": [1, 2, 3], "max_tokens": 4})
            load.join(120)
            answered_s = time.monotonic() - killed
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    text = log_path.read_text(errors="replace")
    return {"kill_rank": args.kill_rank, "kill_after_s": args.kill_after, "concurrency": c,
            "workers_exited_s": exited_s, "workers_still_alive": [p.pid for p in alive],
            "health_status": health.status_code, "unhealthy_after_s": unhealthy_s,
            "completion_status": late.status_code,
            "load_finished": not load.is_alive(), "load_done_s": answered_s,
            "failed_streams": result.get("failed"), "completed_streams": result.get("completed"),
            "log_names_rank": f"rank {args.kill_rank}" in text, "log_tail": text[-1500:]}


def offline(ckpt: Path, args) -> dict[int, dict]:
    """The same load through ``LLM.generate``: output tokens/s per concurrency."""
    llm = LLM(str(ckpt), **engine_options(args))
    llm.compile()  # as the server did before its first request: no trace inside a timed wave
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    llm.generate([[1] * args.input_len], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    rows = {}
    for c in args.concurrency:
        waves = []
        for _ in range(args.waves):
            prompts = [torch.randint(0, 256, (args.input_len,), generator=g).tolist() for _ in range(c)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            waves.append(time.perf_counter() - t0)
        rows[c] = {"offline_tokens_per_s": args.waves * c * args.output_len / sum(waves),
                   "offline_wave_s": statistics.median(waves)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen3-1.7b", choices=sorted(MODELS), help="the shape")
    ap.add_argument("--layers", type=count(1), default=None, help="cut the model to this many layers")
    ap.add_argument("--concurrency", nargs="+", type=count(1), default=[1, 4, 16, 64], help="streams in flight")
    ap.add_argument("--waves", type=count(1), default=2, help="requests per point: waves × concurrency")
    ap.add_argument("--input-len", type=count(1), default=128, help="tokens per prompt")
    ap.add_argument("--output-len", type=count(2), default=256, help="tokens per completion")
    ap.add_argument("--max-num-batched-tokens", type=count(1), default=512, help="new tokens per step")
    ap.add_argument("--port", type=count(1), default=8731, help="the server's port on 127.0.0.1")
    ap.add_argument("--tensor-parallel-size", type=count(1), default=1, help="GPUs (ranks) the server runs on")
    ap.add_argument("--kill-rank", type=count(1), default=None,
                    help="kill this worker rank under load instead of measuring throughput")
    ap.add_argument("--kill-after", type=float, default=10.0, help="seconds into the load before --kill-rank")
    ap.add_argument("--prebuild", action="store_true", help="build the kernels into $MPK_CACHE_DIR, time nothing")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    args.cfg = replace(MODELS[args.model], layers=args.layers) if args.layers else MODELS[args.model]
    if args.kill_rank is not None and args.kill_rank >= args.tensor_parallel_size:
        ap.error(f"--kill-rank {args.kill_rank}: expected a worker rank in [1, {args.tensor_parallel_size})")
    if args.prebuild:
        prebuild(args)
        return 0
    if not torch.cuda.is_available():
        print("serve_throughput.py needs a CUDA device (--prebuild builds its kernels without one)", file=sys.stderr)
        return 2
    from mpk.testing.engine import tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(Path(tmp) / args.model, args.cfg, seed=0, init_std=0.02, dtype=torch.bfloat16)
        if args.kill_rank is not None:
            row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                   "model": args.model, "layers": args.cfg.layers, "tp": args.tensor_parallel_size,
                   **kill_under_load(ckpt, args, Path(tmp) / "server.log")}
            emit_row(row, args.out)
            ok = row["workers_exited_s"] is not None and row["workers_exited_s"] <= 30 and row["log_names_rank"] \
                and row["health_status"] == 503 and row["completion_status"] == 503 and row["load_finished"]
            print(f"\nkill rank {args.kill_rank} of {args.tensor_parallel_size}: workers exited in "
                  f"{row['workers_exited_s']} s, /health {row['health_status']}, completion {row['completion_status']}, "
                  f"streams failed {row['failed_streams']}, log names the rank: {row['log_names_rank']} -> "
                  f"{'PASS' if ok else 'FAIL'}")
            return 0 if ok else 1
        proc = serve(ckpt, args)
        try:
            online = served(args)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        local = offline(ckpt, args)
    rows = []
    for c in args.concurrency:
        s, o = online[c], local[c]
        row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "model": args.model,
               "layers": args.cfg.layers, "concurrency": c, **{k: v for k, v in s.items() if k != "load"},
               **o, "server_overhead": 1 - s["output_tokens_per_s"] / o["offline_tokens_per_s"]}
        emit_row(row, args.out)
        rows.append(row)
    print(f"\n{'c':>3s} {'served tok/s':>12s} {'offline tok/s':>13s} {'overhead':>8s} {'TTFT p50/p99 ms':>16s} "
          f"{'TPOT p50/p99 ms':>16s} {'failed':>6s}")
    for r in rows:
        print(f"{r['concurrency']:3d} {r['output_tokens_per_s']:12.0f} {r['offline_tokens_per_s']:13.0f} "
              f"{r['server_overhead']:8.1%} {r['ttft_p50_ms']:7.1f}/{r['ttft_p99_ms']:<8.1f} "
              f"{r['tpot_p50_ms']:7.2f}/{r['tpot_p99_ms']:<8.2f} {r['failed']:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
