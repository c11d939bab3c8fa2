"""The engine over a tensor-parallel job: rank 0 (the driver: ``mpk.LLM``, ``mpk serve``)
schedules, sends each step's inputs to the workers and runs its own shard (``ParallelRunner``);
every other rank runs ``worker``: it takes the engine's configuration from rank 0, loads the
model on its GPU, compiles its shard and runs the steps rank 0 sends until rank 0 stops.

Start-up: rank 0 starts ranks 1…N-1 itself (``start_job``) unless torchrun started them (then
the other ranks' ``mpk.LLM(...)`` calls become workers and end their processes), then
every rank joins, initialises NVSHMEM (GPU executor), compiles, and all compare a digest of
their compiled tables and configuration (``agree``: a mismatch names the ranks that differ).
A rank that dies stops the others (the job's monitor): GPU launches are aborted and the
engine's next step raises ``RankFailedError`` naming the dead rank.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mpk.distributed.launch import Job, RankInfo, check_gpus, join, start_driver
from mpk.distributed.steps import StepChannel, agree, serve_steps
from mpk.engine.runner import ModelRunner, StepInputs
from mpk.errors import OptionError, RankFailedError, WatchdogTimeout

WORKER = "mpk.engine.parallel:worker"


@dataclass(frozen=True)
class EngineConfig:
    """What every rank needs to build the same runner: the model (a checkpoint path, or None
    for the default model), the device type ("cuda": each rank on its local rank's GPU), the
    dtype and the ModelRunner's arguments (``num_pages`` None until rank 0, having loaded the
    model, decides it)."""

    model: str | None
    device: str
    dtype: torch.dtype
    executor: str
    max_num_seqs: int
    max_num_batched_tokens: int
    num_pages: int | None
    page_size: int
    max_model_len: int
    buckets: list[int] | None = None

    def runner_args(self) -> dict[str, Any]:
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "num_pages": self.num_pages, "page_size": self.page_size, "max_model_len": self.max_model_len,
                "executor": self.executor, "buckets": self.buckets}


def check_parallel(world: int, executor: str | None, device: torch.device, model: Any) -> None:
    """OptionError unless a job of ``world`` ranks can run: one visible GPU per rank for the
    GPU executor (the default); ``executor="eager"`` asked for explicitly runs a full replica
    per rank in PyTorch, on the CPU too (the launcher's test); a checkpoint every rank loads."""
    if executor not in (None, "gpu", "eager"):
        raise OptionError(f"executor={executor!r} with tensor_parallel_size={world}; expected 'gpu' (or 'eager', "
                          "which runs a full replica per rank)")
    if executor != "eager" or device.type == "cuda":
        check_gpus(world)
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise OptionError(f"a model of type {type(model).__name__} with tensor_parallel_size={world}; expected a "
                          "checkpoint path (or None: the default model), which every rank loads itself")


def start_job(world: int, timeout_s: float = 30.0) -> Job:
    """Rank 0's job: joined from torchrun's environment when torchrun started ``world``
    ranks, else started here (ranks 1…world-1 run ``worker``). Under torchrun a rank other
    than 0 serves rank 0's steps here and then ends the process (``SystemExit(0)``): code after
    ``mpk.LLM(...)`` runs on rank 0 only."""
    info = RankInfo.from_env()
    if info is None or info.world == 1:
        return start_driver(world, WORKER, {}, timeout_s=timeout_s)
    if info.world != world:
        raise OptionError(f"tensor_parallel_size={world} under torchrun with WORLD_SIZE={info.world}; expected equal")
    job = join(info, timeout_s=timeout_s)
    if info.rank == 0:
        return job
    try:
        worker(job)
    finally:
        job.close()
    raise SystemExit(0)


def _device(job: Job, device: str) -> torch.device:
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(job.info.local_rank)
    return torch.device("cuda", job.info.local_rank)


def _nvshmem(job: Job, executor: str) -> Any:
    """GPU ranks: NVSHMEM over the job's group (its allocator; None for eager replicas); a
    failed peer abandons its collective teardown and aborts this process's launches. The
    caller closes it on every rank at one point of the protocol: after the last step."""
    if executor != "gpu":
        return None
    from mpk.distributed.nvshmem import init_nvshmem
    from mpk.executors.gpu import abort_all

    allocator = init_nvshmem(job.control, close_at_exit=False)
    job.monitor.on_failure(allocator.abandon)
    job.monitor.on_failure(abort_all)
    return allocator


def startup_digest(runner: ModelRunner, config: EngineConfig) -> str:
    """What ranks compare at start-up: every graph's tables (rank left out) and the config."""
    runner.compile(progress=False)
    doc = repr((sorted(runner.buckets.report.digests.items()), asdict(config) | {"dtype": str(config.dtype)},
                runner.model.cfg))
    return hashlib.sha256(doc.encode()).hexdigest()


def announce(job: Job, config: EngineConfig) -> Any:
    """Rank 0, before it loads the model: the workers get ``config`` (and load theirs
    meanwhile); NVSHMEM starts on every rank. Returns this rank's allocator (None: eager)."""
    StepChannel(job).send(config)
    return _nvshmem(job, config.executor)


def worker(job: Job) -> None:
    """A worker rank: the engine's configuration from rank 0 (``announce``), the model loaded,
    the page count once rank 0 decided it (``ParallelRunner``), then its steps until rank 0
    stops."""
    from mpk.engine.loading import load_model

    channel = StepChannel(job)
    _, config = channel.recv()
    device = _device(job, config.device)
    allocator = _nvshmem(job, config.executor)
    try:
        model, _, _ = load_model(config.model, config.dtype, device, config.max_model_len)
        _, config = channel.recv()
        runner = ModelRunner(model, tensor_parallel=(job.rank, job.world), **config.runner_args())
        agree(job, startup_digest(runner, config))
        serve_steps(job, runner.forward)
    except BaseException:
        if allocator is not None:  # the others are told by the monitor; no collective teardown
            allocator.abandon()
        raise
    if allocator is not None:  # with rank 0, which closes its own after the stop
        allocator.close()


class ParallelRunner(ModelRunner):
    """Rank 0's runner (after ``announce``, whose allocator it takes over): each step's inputs
    go to the workers before its own shard runs; a failed rank turns the step into
    ``RankFailedError`` naming it. ``close()`` stops the workers and leaves the job."""

    def __init__(self, job: Job, model: Any, config: EngineConfig, allocator: Any):
        self.job, self.channel, self.allocator = job, StepChannel(job), allocator
        self.channel.send(config)  # with the page count: the workers build and compile meanwhile
        try:
            super().__init__(model, tensor_parallel=(job.rank, job.world), **config.runner_args())
            agree(job, startup_digest(self, config))
        except BaseException:
            if self.allocator is not None:
                self.allocator.abandon()
            raise

    def forward(self, step: StepInputs) -> torch.Tensor:
        self.channel.send(step)
        return super().forward(step)

    def execute(self, rows: list) -> list:
        try:
            out = super().execute(rows)
        except (WatchdogTimeout, RuntimeError) as e:  # a launch waiting for a dead peer, aborted
            if self.job.monitor.failure is not None:
                raise self.job.monitor.failure from e
            raise
        # an aborted launch's outputs are not valid: a failure filed meanwhile voids the step
        self.job.monitor.check()
        return out

    def close(self) -> None:
        """Stop the workers, tear NVSHMEM down with them, leave the job (once)."""
        if self.job.closed:
            return
        try:
            if self.job.monitor.failure is None:
                self.channel.stop()
        except RankFailedError:  # stopping anyway; the workers were told by the monitor
            pass
        finally:
            if self.allocator is not None:
                if self.job.monitor.failure is not None:
                    self.allocator.abandon()
                self.allocator.close()
            self.job.close()
