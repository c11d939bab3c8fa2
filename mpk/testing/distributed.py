"""Worker targets for the launcher's CPU tests (tests/distributed): fake steps that record
what they were sent in the job's store, so the driver can check every rank ran every step."""

from __future__ import annotations

import os

from mpk.distributed.launch import Job
from mpk.distributed.steps import agree, serve_steps


def record(job: Job, inputs: object) -> None:
    """A fake step: append ``inputs`` to this rank's list in the store (``steps/<rank>``)."""
    job.store.append(f"steps/{job.rank}", f"{inputs!r};")


def echo_worker(job: Job, digest: str = "same", die_at: int | None = None, die_rank: int = 1) -> None:
    """Agree on ``digest`` (a rank may pass another: ``{rank: digest}`` as a string
    "rank=digest,..."), then run ``record`` for each step; rank ``die_rank`` dies (exit
    status 3) on step ``die_at`` instead."""
    mine = dict(pair.split("=") for pair in digest.split(",")) if "=" in digest else {}
    agree(job, mine.get(str(job.rank), "same") if mine else digest)
    steps = 0

    def step(inputs: object) -> None:
        nonlocal steps
        if die_at is not None and steps == die_at and job.rank == die_rank:
            os._exit(3)
        record(job, inputs)
        steps += 1

    serve_steps(job, step)
