"""The GPU executor's test of whether a launch's arguments are the last full bind's
(``_unmoved``), on the CPU: a launch that skips re-binding must not miss an argument moved,
reshaped, restrided or retyped, by a new tensor or in place (its kernel would read the old
address or layout), while new values in place keep the fast path."""

from __future__ import annotations

import random
import types

import torch

from mpk.executors.gpu import _KEYS, GpuExecutor


def _bound(args):
    """An executor's record of a full bind of ``args``, as ``GpuExecutor._bind`` leaves it."""
    return types.SimpleNamespace(_bound_keys=[list(map(key, args)) for key in _KEYS])


CHANGES = ("none", "values", "new tensor", "set_", "view", "t_", ".data = transposed", ".data = retyped",
           "non-tensor")


def test_same_tensors_are_unmoved_and_any_change_is_seen():
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    for change in CHANGES:
        args = [torch.randn(random.randint(2, 9), 8, generator=g) for _ in range(200)]
        i = random.randrange(len(args))
        if change in ("t_", ".data = transposed"):
            args[i] = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        elif change == ".data = retyped":
            args[i] = torch.nn.Parameter(torch.randn(8, 8, generator=g, dtype=torch.bfloat16))
        ex = _bound(args)
        with torch.no_grad():
            if change == "values":
                args[i].copy_(torch.randn(args[i].shape, generator=g))
            elif change == "new tensor":
                args[i] = args[i].clone()
            elif change == "set_":  # the same object on new storage
                args[i].set_(torch.randn(args[i].shape, generator=g))
            elif change == "view":  # another tensor at the same address, with another shape
                args[i] = args[i].view(-1)
            elif change == "t_":  # the same object and address, strides swapped in place
                args[i].t_()
        if change == ".data = transposed":  # the same again, without a version bump
            args[i].data = args[i].data.t()
        elif change == ".data = retyped":  # same address, shape and strides; another dtype
            args[i].data = args[i].data.view(torch.float16)
        elif change == "non-tensor":
            args[i] = 3
        assert GpuExecutor._unmoved(ex, args) == (change in ("none", "values")), change
    # no full bind yet (or the last one copied a strided argument): never unmoved
    assert not GpuExecutor._unmoved(types.SimpleNamespace(_bound_keys=None), args)
