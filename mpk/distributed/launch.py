"""Starting the ranks of a tensor-parallel job and joining them.

A rank is started either by torchrun (``torchrun --nproc-per-node N``: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in its environment) or by the
driver, rank 0 (``mpk.LLM(tensor_parallel_size=N)``, ``mpk serve --tensor-parallel-size N``),
which starts ranks 1…N-1 as ``python -m mpk.distributed.worker`` processes with the same
variables, so a worker cannot tell the two apart. Every rank then ``join``s: a TCP store on
rank 0 (or torchrun's agent), a torch.distributed group over it, a gloo group for the host's
messages, and a ``Monitor`` of the others.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from mpk.distributed.monitor import Monitor
from mpk.errors import DistributedError, OptionError

# NVLink multicast (NVLS) stays off: the communication tasks use peer pointers only, and a
# multicast object costs memory and setup time on hosts that have the feature at all
NO_MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_multicast(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Set ``NO_MULTICAST`` in ``env`` (the process's environment, inherited by what it starts)."""
    env.update(NO_MULTICAST)


@dataclass(frozen=True)
class RankInfo:
    """Where one rank stands in its job: its rank, the world size, its GPU on the node, and
    the address of the job's store (rank 0's, or torchrun's agent's)."""

    rank: int
    world: int
    local_rank: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RankInfo | None":
        """The rank torchrun (or the driver) described in ``env``; None outside such a job
        (no ``WORLD_SIZE``)."""
        if "WORLD_SIZE" not in env:
            return None
        values = {}
        for name, least in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("MASTER_PORT", 1)):
            text = env.get(name, "0" if name == "LOCAL_RANK" else None)
            try:
                values[name] = int(text) if text is not None else None
            except ValueError:
                values[name] = None
            if values[name] is None or values[name] < least:
                raise DistributedError(f"{name}={text!r} in the environment; expected an integer ≥ {least} (torchrun "
                                       "sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
        if values["RANK"] >= values["WORLD_SIZE"]:
            raise DistributedError(f"RANK={values['RANK']} with WORLD_SIZE={values['WORLD_SIZE']}; expected a rank in "
                                   f"[0, {values['WORLD_SIZE']})")
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], env.get("MASTER_ADDR", "127.0.0.1"),
                   values["MASTER_PORT"])

    def env(self) -> dict[str, str]:
        """The variables that describe this rank (as torchrun sets them)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def check_gpus(world: int, visible: int | None = None) -> None:
    """OptionError unless ``world`` is an int ≥ 1 and at most the visible GPUs (one per rank)."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise OptionError(f"tensor_parallel_size={world!r}; expected an int ≥ 1 (one GPU per rank)")
    visible = torch.cuda.device_count() if visible is None else visible
    if world > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise OptionError(f"tensor_parallel_size={world}; expected at most the {visible} visible GPU(s), one per rank"
                          + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the job's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Job:
    """This rank's membership of a joined job: ``info``, the store, the gloo group the host's
    messages travel on (``control``), the monitor, and on the driver the worker processes.
    ``close()`` leaves (the driver first waits for its workers, then ends the stragglers)."""

    info: RankInfo
    store: Any
    control: Any
    monitor: Monitor
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    closed: bool = False

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world(self) -> int:
        return self.info.world

    def abort(self, why: str) -> None:
        """Leave after an error on this rank: the others are told (they stop, naming this
        rank), the workers this rank started are ended, then ``close``."""
        try:
            self.store.compare_set("mpk/failed", "", f"{self.rank}:rank {self.rank} failed: {why}")
        except Exception:  # the store went with rank 0: the workers see that themselves
            pass
        for p in self.procs.values():
            p.kill()
        self.close()

    def close(self, wait_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.monitor.close()
        for p in self.procs.values():
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:  # bounded: a worker stuck on the GPU is ended
                p.kill()
                p.wait(wait_s)
        if dist.is_initialized():
            dist.destroy_process_group()


# the groups' own limit: a server's workers wait for the next step as long as it idles; a dead
# peer is found by the monitor (a closed socket fails the collective at once, and the driver
# kills a worker that stopped beating), not by a collective's timeout
IDLE_LIMIT = timedelta(days=7)


def join(info: RankInfo, backend: str = "gloo", timeout_s: float = 30.0,
         procs: Mapping[int, subprocess.Popen] = {}, start_timeout_s: float = 600.0) -> Job:
    """Join ``info``'s job: the store (hosted here on rank 0 unless torchrun's agent hosts it),
    the default process group (``backend``: "gloo", or "nccl" for a peer that all-reduces with
    NCCL), a gloo group for host messages, and a started ``Monitor`` (``timeout_s``: how long
    a silent rank is waited for). ``procs``: the workers this rank started (the driver's).
    ``start_timeout_s``: how long to wait for every rank to arrive (workers import torch)."""
    if dist.is_initialized():
        raise DistributedError("torch.distributed is initialised already; expected mpk to join the job itself "
                               "(one job per process)")
    disable_multicast()
    # torchrun's agent hosts the store itself and says so (as torch's env:// rendezvous reads it)
    hosts = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world, hosts,
                              timedelta(seconds=start_timeout_s), wait_for_workers=False)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=info.rank, world_size=info.world,
                                timeout=IDLE_LIMIT)
        control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_LIMIT)
    except (RuntimeError, ValueError, OSError) as e:
        raise DistributedError(f"rank {info.rank} of {info.world} could not join the job at "
                               f"{info.master_addr}:{info.master_port} within {start_timeout_s:g} s: {e}") from e
    monitor = Monitor(dist.PrefixStore("mpk", store), info.rank, info.world, timeout_s, procs).start()
    return Job(info, store, control, monitor, dict(procs))


def spawn_workers(world: int, target: str, kwargs: Mapping[str, Any], port: int, backend: str = "gloo",
                  timeout_s: float = 30.0, host: str = "127.0.0.1") -> dict[int, subprocess.Popen]:
    """Start ranks 1…world-1 as ``python -m mpk.distributed.worker`` with torchrun's
    variables; each joins (``backend``, ``timeout_s``: as ``join`` takes them) and calls
    ``target`` ("module:function") with its ``Job`` and ``kwargs`` (all pickled to its
    stdin). Multicast stays off in their environment."""
    env = dict(os.environ)
    disable_multicast(env)
    spec = pickle.dumps((target, dict(kwargs), backend, timeout_s))
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank in range(1, world):
            info = RankInfo(rank, world, rank, host, port)
            # a session of their own: a Ctrl-C or SIGTERM to rank 0's process group (a terminal,
            # a container's stop) reaches rank 0 only, which drains and then stops them; a rank 0
            # that dies is noticed by their monitors
            p = subprocess.Popen([sys.executable, "-m", "mpk.distributed.worker"], stdin=subprocess.PIPE,
                                 env=env | info.env(), start_new_session=True)
            procs[rank] = p
            p.stdin.write(spec)
            p.stdin.close()
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    return procs


def start_driver(world: int, target: str, kwargs: Mapping[str, Any], backend: str = "gloo",
                 timeout_s: float = 30.0) -> Job:
    """Rank 0 of a job it starts itself: workers 1…world-1 running ``target`` (see
    ``spawn_workers``), joined on a free port of 127.0.0.1."""
    port = free_port()
    procs = spawn_workers(world, target, kwargs, port, backend, timeout_s)
    try:
        return join(RankInfo(0, world, 0, "127.0.0.1", port), backend, timeout_s, procs)
    except BaseException:
        for p in procs.values():
            p.kill()
            p.wait()
        raise
