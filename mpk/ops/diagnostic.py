"""``stamp``: a diagnostic op for runtime tests and benchmarks, not produced by any model.

Each task appends (start, end) positions of a device-wide clock to a log for the tile's
element, spinning a pseudo-random share (fixed per tile) of ``busy_ns`` in between; dependencies come from the caller (the stress test
sets them directly), not from regions. Inputs: clock [1] int64, runs [N] int64, log [I, N, 2]
int64 (written in place, outside the functional model: a test harness op). Output [N] int64:
the number of times each task ran. ``record=False``: empty tasks that do nothing.
"""

from __future__ import annotations

from mpk.ops.gpu import GpuSpec
from mpk.ops.registry import OpDef, OpSig, register


def _stamp_regions(sig: OpSig, rect):
    return [None, None, None]  # the log is written in place; nothing is read through regions


def _stamp_cpu(sig: OpSig, rect, xs):
    raise NotImplementedError("stamp tasks run on the GPU runtime only")


register(OpDef(kind="stamp", type_id=90, input_regions=_stamp_regions, cpu=_stamp_cpu,
               gpu=GpuSpec(params=lambda op: ([int(op.attrs["busy_ns"]), int(op.attrs["record"])], []),
                           float64_exact=True),
               doc="runtime diagnostic: log (start, end) clock stamps per task and iteration"))
