"""The tensor-parallel launcher on the CPU: ranks started by the driver (gloo on 127.0.0.1),
each step's inputs broadcast to every worker, the start-up agreement naming the ranks that
differ, and a rank that dies or hangs stopping the job within the monitor's limit, named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mpk.distributed.launch import NO_MULTICAST, RankInfo, check_gpus, disable_multicast, start_driver
from mpk.distributed.steps import StepChannel, agree
from mpk.errors import DistributedError, OptionError, RankFailedError, RankMismatchError

WORKER = "mpk.testing.distributed:echo_worker"
LIMIT_S = 3.0  # the monitor's limit in these tests (the engine's default is the watchdog's 30 s)


def _reap(job) -> None:
    for p in job.procs.values():
        if p.poll() is None:
            p.kill()
        p.wait(10)
    job.close(wait_s=1)


def test_rank_info_reads_torchruns_variables_and_names_a_bad_one():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    info = RankInfo.from_env(env)
    assert info == RankInfo(2, 4, 1, "10.0.0.1", 1234) and RankInfo.from_env(info.env()) == info
    assert RankInfo.from_env({}) is None
    with pytest.raises(DistributedError, match="RANK='x'"):
        RankInfo.from_env(env | {"RANK": "x"})
    with pytest.raises(DistributedError, match=r"RANK=4 with WORLD_SIZE=4; expected a rank in \[0, 4\)"):
        RankInfo.from_env(env | {"RANK": "4"})


def test_gpu_count_and_multicast_settings():
    check_gpus(2, visible=2)
    with pytest.raises(OptionError, match="tensor_parallel_size=3; expected at most the 2 visible GPU"):
        check_gpus(3, visible=2)
    with pytest.raises(OptionError, match="tensor_parallel_size=0"):
        check_gpus(0, visible=2)
    env = {"NCCL_NVLS_ENABLE": "1"}
    disable_multicast(env)
    assert env == NO_MULTICAST and NO_MULTICAST["NVSHMEM_DISABLE_NVLS"] == "1"


def test_every_worker_runs_every_step_then_exits_cleanly():
    job = start_driver(2, WORKER, {}, timeout_s=LIMIT_S)
    try:
        agree(job, "same")
        channel = StepChannel(job)
        sent = [{"step": i, "tokens": [i, i + 1]} for i in range(4)]
        for step in sent:
            channel.send(step)
        channel.stop()
        job.close()
        expected = "".join(f"{s!r};" for s in sent).encode()
        assert job.store.get("steps/1") == expected
        assert [p.returncode for p in job.procs.values()] == [0]
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # set before the workers started (they inherit it)
    finally:
        _reap(job)


def test_disagreeing_ranks_are_named_on_every_rank():
    job = start_driver(2, WORKER, {"digest": "0=a,1=b"}, timeout_s=LIMIT_S)
    try:
        with pytest.raises(RankMismatchError, match=r"rank\(s\) \[1\] have other compiled tables than rank 0") as e:
            agree(job, "a")
        assert e.value.ranks == (1,)
        for p in job.procs.values():  # the workers raise it too, and exit with status 1
            assert p.wait(30) == 1
    finally:
        _reap(job)


def test_a_dead_worker_is_named_and_stops_the_others():
    job = start_driver(3, WORKER, {"die_at": 1, "die_rank": 1}, timeout_s=LIMIT_S)
    try:
        agree(job, "same")
        channel = StepChannel(job)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with status 3") as e:
            for i in range(10_000):  # the worker dies at its second step; the driver notices
                channel.send(i)
                time.sleep(0.01)
        assert e.value.rank == 1 and time.monotonic() - start < LIMIT_S + 5
        # rank 2 stops by itself (the failure is written to the job's store), within the limit
        assert job.procs[2].wait(LIMIT_S + 10) != 0
    finally:
        _reap(job)


def test_a_hung_worker_is_named_within_the_limit_and_ended():
    job = start_driver(2, WORKER, {}, timeout_s=LIMIT_S)
    try:
        agree(job, "same")
        os.kill(job.procs[1].pid, signal.SIGSTOP)  # alive, silent: no heartbeat
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 sent no heartbeat") as e:
            channel = StepChannel(job)
            while time.monotonic() - start < 4 * LIMIT_S:
                channel.send("step")
                time.sleep(0.05)
        waited = time.monotonic() - start
        assert e.value.rank == 1 and LIMIT_S <= waited < LIMIT_S + 3
        assert job.procs[1].wait(10) == -signal.SIGKILL  # the driver ended it
    finally:
        _reap(job)


DRIVER = textwrap.dedent("""
    import os, sys
    from mpk.distributed.launch import start_driver
    from mpk.distributed.steps import agree
    job = start_driver(2, "mpk.testing.distributed:echo_worker", {}, timeout_s=float(sys.argv[1]))
    agree(job, "same")
    print(*[p.pid for p in job.procs.values()], flush=True)
    sys.stdin.readline()
    os._exit(9)  # rank 0 dies without a word
""")


def test_workers_exit_when_rank_0_dies():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(LIMIT_S)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 1
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(30) == 9
        deadline = time.monotonic() + LIMIT_S + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.1)
        assert not alive, f"workers {alive} outlived rank 0"
    finally:
        driver.kill()
        driver.wait()


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (the workers are the driver's children, not ours: once they
    exit, init reaps them, or they linger as zombies, which count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- the monitor alone: in-process, on a HashStore (no processes, no sockets) ---


class _Exited:
    """A started process's stand-in that has exited with ``code``."""

    pid = 4242

    def __init__(self, code: int):
        self.code, self.killed = code, False

    def poll(self) -> int:
        return self.code

    def kill(self) -> None:
        self.killed = True


def _monitor(store, rank: int, world: int, **kw):
    from mpk.distributed.monitor import Monitor

    return Monitor(store, rank, world, timeout_s=0.3, interval_s=0.02, exit_grace_s=None, **kw)


def test_monitor_names_a_silent_rank_and_the_others_learn_it_from_the_store():
    import torch.distributed as dist

    store = dist.HashStore()
    ranks = [_monitor(store, r, 3) for r in range(3)]
    aborted = []
    ranks[0].on_failure(lambda: aborted.append(0))
    for m in ranks:
        m.start()
    try:
        time.sleep(0.6)  # everyone beats: nobody is reported
        assert all(m.failure is None for m in ranks)
        ranks[2]._stop.set()  # rank 2 falls silent (its thread ends without a goodbye)
        start = time.monotonic()
        assert ranks[0].wait_failure(5) is not None and ranks[1].wait_failure(5) is not None
        assert time.monotonic() - start < 2
        for m in ranks[:2]:
            assert m.failure.rank == 2 and "rank 2 sent no heartbeat" in str(m.failure)
        assert aborted == [0]
        ranks[0].on_failure(lambda: aborted.append("late"))  # registered after: runs at once
        assert aborted == [0, "late"]
        with pytest.raises(RankFailedError, match="rank 2"):
            ranks[0].check()
    finally:
        for m in ranks:
            m.close()


def test_monitor_leaves_a_rank_that_said_goodbye_alone_and_sees_its_own_process_exit():
    import torch.distributed as dist

    store = dist.HashStore()
    a, b = _monitor(store, 0, 2).start(), _monitor(store, 1, 2).start()
    try:
        b.close()  # a clean goodbye
        time.sleep(0.8)
        assert a.failure is None
    finally:
        a.close()
    proc = _Exited(7)
    c = _monitor(dist.HashStore(), 0, 2, procs={1: proc}).start()
    try:
        assert c.wait_failure(5) is not None and c.failure.rank == 1
        assert "rank 1 (pid 4242) exited with status 7" in str(c.failure) and proc.killed
    finally:
        c.close()
