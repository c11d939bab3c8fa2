"""The driver's messages to its workers: each step's inputs broadcast from rank 0 over the
job's gloo group (``StepChannel``), the loop a worker runs them in (``serve_steps``), and the
start-up check that every rank compiled the same tables (``agree``).

Rank 0 schedules; the workers only run the step rank 0 scheduled, on their own GPU and shard,
so a message is whatever the step function needs (the page table's rows and the new tokens:
``mpk.engine.runner.StepInputs``). A collective that fails because a peer died is reported as
the monitor's ``RankFailedError`` naming that peer, not as gloo's socket error."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

from mpk.distributed.launch import Job
from mpk.errors import DistributedError, RankMismatchError

T = TypeVar("T")
STEP, STOP = "step", "stop"


def _guarded(job: Job, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, a collective of ``job``; the monitor's failure when a peer is gone."""
    job.monitor.check()
    try:
        return fn()
    except Exception as e:  # gloo says "connection closed by peer": the monitor names the peer
        failure = job.monitor.wait_failure(3 * job.monitor.interval_s + 1)
        if failure is not None:
            raise failure from e
        raise DistributedError(f"rank {job.rank}: {what} failed: {type(e).__name__}: {e}") from e


class StepChannel:
    """Rank 0 ``send``s each step's inputs and finally ``stop``s; a worker ``recv``s them."""

    def __init__(self, job: Job):
        self.job = job

    def _broadcast(self, message: tuple[str, Any] | None) -> tuple[str, Any]:
        box = [message]
        _guarded(self.job, "the step broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.job.control))
        return box[0]

    def send(self, inputs: Any) -> None:
        """Rank 0: every worker runs a step of ``inputs``."""
        self._broadcast((STEP, inputs))

    def stop(self) -> None:
        """Rank 0: the workers leave their loop."""
        self._broadcast((STOP, None))

    def recv(self) -> tuple[str, Any]:
        """A worker: the next message, (STEP, inputs) or (STOP, None)."""
        return self._broadcast(None)


def serve_steps(job: Job, step: Callable[[Any], Any]) -> int:
    """A worker's loop: run ``step(inputs)`` for each step rank 0 sends until it stops;
    returns the steps run."""
    channel, done = StepChannel(job), 0
    while True:
        kind, inputs = channel.recv()
        if kind == STOP:
            return done
        step(inputs)
        done += 1


def agree(job: Job, digest: str, what: str = "compiled tables") -> None:
    """Every rank passes its ``digest`` of ``what``; raises ``RankMismatchError`` on every
    rank, naming the ranks whose digest differs from rank 0's, unless all are equal."""
    digests: list[Any] = [None] * job.world
    _guarded(job, f"comparing the {what}", lambda: dist.all_gather_object(digests, digest, group=job.control))
    differ = tuple(r for r, d in enumerate(digests) if d != digests[0])
    if differ:
        shown = ", ".join(f"rank {r}: {str(d)[:12]}" for r, d in enumerate(digests))
        raise RankMismatchError(f"rank(s) {list(differ)} have other {what} than rank 0 ({shown}); expected every rank "
                                "to run the same mpk, model, options and tensor_parallel_size", differ)
