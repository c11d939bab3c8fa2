"""``mpk.LLM(tensor_parallel_size=N)`` and the CLI's ``--tensor-parallel-size`` on the CPU:
option checks, and an engine whose workers are eager replicas (``executor="eager"``), which
exercises the launcher, the configuration hand-over, the start-up agreement and the step
broadcast of the real engine: its tokens equal one process's. A worker that dies turns the
next step into ``RankFailedError`` naming it; the server then answers 503."""

from __future__ import annotations

import random
import shutil
import subprocess
import textwrap
import time
from functools import partial

import pytest
import torch

from mpk.cli import main
from mpk.engine.llm import LLM
from mpk.engine.parallel import check_parallel
from mpk.engine.sampling import SamplingParams
from mpk.errors import OptionError, RankFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def random_prompt(n: int) -> list[int]:
    return [random.randrange(256) for _ in range(n)]


def test_options_are_checked_before_anything_starts(checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # (the same on a one-GPU machine)
    cpu = torch.device("cpu")
    with pytest.raises(OptionError, match="tensor_parallel_size=2; expected at most the 1 visible GPU"):
        check_parallel(2, None, cpu, checkpoint)  # no GPU here: only an explicit eager replica runs
    with pytest.raises(OptionError, match="executor='cpu' with tensor_parallel_size=2"):
        check_parallel(2, "cpu", cpu, checkpoint)
    with pytest.raises(OptionError, match="a model of type DecoderLM .* expected a checkpoint path"):
        check_parallel(2, "eager", cpu, torch.nn.Module.__new__(type("DecoderLM", (torch.nn.Module,), {})))
    check_parallel(2, "eager", cpu, checkpoint)
    with pytest.raises(OptionError, match="tensor_parallel_size=2; expected at most"):
        LLM(checkpoint, tensor_parallel_size=2, device="cpu")


def test_torchruns_world_must_be_the_engines(monkeypatch):
    from mpk.engine.parallel import start_job

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(OptionError, match="tensor_parallel_size=4 under torchrun with WORLD_SIZE=2; expected equal"):
        start_job(4)


def test_cli_flag_reaches_the_engine(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["generate", "--model", str(checkpoint), "--prompt", "hi", "--tensor-parallel-size", "3",
                 "--max-model-len", "64"]) == 2
    assert "tensor_parallel_size=3; expected at most the 1 visible GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--tensor-parallel-size", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_replicas_give_one_process_tokens_and_a_dead_worker_is_named(checkpoint):
    prompts = [random_prompt(n) for n in (5, 17, 9)]
    options = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16, "executor": "eager",
               "device": "cpu"}
    alone = [o.outputs[0].token_ids for o in LLM(checkpoint, **options).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(checkpoint, tensor_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == alone
        worker = llm.job.procs[1]
        worker.kill()
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {worker.pid}\) exited") as e:
            while time.monotonic() - start < 60:
                llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert e.value.rank == 1
    finally:
        llm.close()
    assert llm.job.closed


TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys
    from mpk.engine.llm import LLM
    from mpk.engine.sampling import SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, executor="eager", device="cpu", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    out = llm.generate([[1, 2, 3], [40, 50]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    print("rank 0 tokens", [o.outputs[0].token_ids for o in out], flush=True)
    llm.close()
""")


def test_under_torchrun_every_rank_calls_llm_and_rank_0_generates(checkpoint, tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([torchrun, "--nproc-per-node", "2", "--standalone", str(script), str(checkpoint)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    alone = LLM(checkpoint, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, executor="eager",
                device="cpu").generate(
        [[1, 2, 3], [40, 50]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    # rank 1's LLM() served rank 0 and ended its process: one line of tokens, rank 0's
    assert done.stdout.count("rank 0 tokens") == 1
    assert f"rank 0 tokens {[o.outputs[0].token_ids for o in alone]}" in done.stdout


def test_the_server_answers_503_after_a_rank_failed(checkpoint):
    import psutil
    from fastapi.testclient import TestClient

    from mpk.serve.app import build_app
    from mpk.serve.engine import AsyncEngine
    from mpk.serve.metrics import Metrics

    # the engine process is rank 0: it starts rank 1, which is therefore its child
    engine = AsyncEngine(partial(LLM, str(checkpoint), tensor_parallel_size=2, max_model_len=64, max_num_seqs=4,
                                 max_num_batched_tokens=16, executor="eager", device="cpu"), Metrics(), max_queue=4)
    engine.start()
    body = {"model": "tiny", "prompt": random_prompt(6), "max_tokens": 4, "temperature": 0}
    try:
        with TestClient(build_app(engine, "tiny")) as client:
            assert client.post("/v1/completions", json=body).status_code == 200
            [rank1] = [p for p in psutil.Process(engine.pid).children()
                       if "mpk.distributed.worker" in " ".join(p.cmdline())]
            assert rank1.environ()["NVSHMEM_DISABLE_NVLS"] == "1"  # (NVLink multicast off in the job)
            rank1.kill()
            # the next step finds the rank gone (its monitor may have reported it already)
            failed = client.post("/v1/completions", json=body)
            assert failed.status_code == 503 and "rank 1" in failed.json()["error"]["message"]
            later = client.post("/v1/completions", json=body)
            assert later.status_code == 503 and "the engine stopped" in later.json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 503 and "rank 1" in health.json()["status"]
            psutil.Process(engine.pid).wait(30)  # the engine process exits, its job with it
    finally:
        engine.stop()


@pytest.mark.gpu
def test_gpu_abort_all_stops_a_launch_waiting_for_a_dead_peer(monkeypatch):
    """What the monitor does when a peer dies: a launch that waits for an event that never
    fires (as for a dead peer's signal) returns within seconds of ``abort_all``, long before its
    watchdog limit, and so does every later launch of the executor."""
    import weakref

    from mpk.executors import gpu
    from mpk.executors.gpu import GpuExecutor, abort_all
    from mpk.testing.random_graphs import stamp_graph, stamp_inputs

    monkeypatch.setattr(gpu, "_LIVE", weakref.WeakSet())  # the other tests' executors stay usable
    preds = [(), (0,), (1,), (1, 2), (3,)]
    tables = stamp_graph(preds, 1)
    tables.events["num_triggers"][int(tables.tasks["dep_event"][3])] += 5  # never reaches its count
    ex = GpuExecutor(tables, timeout_s=120.0, validate_tables=False)
    args = stamp_inputs(tables, 1, "cuda")
    done = ex.launch(args)
    time.sleep(0.5)
    assert not done.query()  # it hangs
    start = time.monotonic()
    abort_all()
    while not done.query():
        assert time.monotonic() - start < 10, "the launch outlived abort_all by 10 s"
        time.sleep(0.01)
    later = ex.launch(args)
    torch.cuda.synchronize()
    assert later.query() and time.monotonic() - start < 15
