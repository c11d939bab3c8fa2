"""``python -m mpk.distributed.worker``: one rank a driver started (``launch.spawn_workers``).
Reads ``(target, kwargs, backend, timeout_s)`` pickled from stdin, joins the job its environment describes and
calls ``target(job, **kwargs)``; exits 0 when it returns, 1 with the error on stderr when it
raises (the driver's monitor then names this rank)."""

from __future__ import annotations

import importlib
import pickle
import sys
import traceback

from mpk.distributed.launch import RankInfo, join


def main() -> int:
    target, kwargs, backend, timeout_s = pickle.loads(sys.stdin.buffer.read())
    info = RankInfo.from_env()
    if info is None:
        print("mpk worker: WORLD_SIZE is not set; expected to be started by mpk.distributed.launch", file=sys.stderr)
        return 2
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    job = join(info, backend, timeout_s)
    try:
        fn(job, **kwargs)
    except BaseException:  # the report goes to the log; the driver sees the exit status
        print(f"mpk worker rank {info.rank}:", file=sys.stderr)
        traceback.print_exc()
        return 1
    finally:
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
