"""Binding a sharded graph's inputs from the caller's full ones (mpk.distributed.shard.InputSpec).

A ``RankBinder`` holds what it made for one rank, so each is made once: weight shards (sliced
from the full weight at the first call and cached; a later call with a different tensor at that
argument, or one modified in place since — torch's version counter — makes it again), the
communication buffers (from the SymmetricAllocator, kept for the binder's life: their sequence
counters and signals carry over from launch to launch) and their peer-address tables.

A state input (the KV cache) is bound live, without a copy, when the caller passes the rank's
shard (its sharded shape) or a full-shaped tensor whose rank slice is contiguous: a
*rank-local* cache (``rank_local``), whose memory holds only the rank's kv heads and whose
other heads alias it (the rank never reads them; nothing else may). Given any other full
tensor, the binder keeps one shard tensor, copies the shard into it when another tensor is
passed (identity or address) and copies it back after every launch, so the caller's tensor
always holds the steps' writes — the rank's part of the whole cache, each step. The caller's
own in-place writes to the full tensor between launches are not read back then: the version
counter cannot tell them from AOT autograd's copy of the returned state into it.

A call whose sliced sources are the last call's tensors, the weights unmodified since
(identity, address and version counter; the state sources by identity and address),
reuses the last argument list: the executor then
sees the addresses it bound last time and skips its own full check.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from mpk.distributed.shard import InputSpec, ShardedGraph
from mpk.distributed.symmetric import SymmetricAllocator
from mpk.errors import ShardingError


class RankBinder:
    """The argument list of ``sharded`` for one call, from the caller's full arguments."""

    def __init__(self, sharded: ShardedGraph, allocator: SymmetricAllocator):
        if (allocator.rank, allocator.world) != (sharded.rank, sharded.world):
            raise ShardingError(f"allocator of rank {allocator.rank} of {allocator.world} for the graph of rank "
                                f"{sharded.rank} of {sharded.world}; expected the same rank and world")
        self.sharded, self.allocator = sharded, allocator
        self._made: dict[int, tuple[Any, torch.Tensor]] = {}  # input → (key of its source, tensor)
        self._sources = sorted({s.source for s in sharded.inputs if s.kind == "slice" and not s.state})
        self._states = sorted({s.source for s in sharded.inputs if s.kind == "slice" and s.state})
        self._fulls = [(i, s.source) for i, s in enumerate(sharded.inputs) if s.kind == "full"]
        # (sources' keys, args, back, the sources): holding the sources keeps their ids and
        # addresses from being reused by other tensors while the keys name them
        self._last: tuple[Any, list[torch.Tensor], list, tuple] | None = None

    def _keys(self, full: Sequence[torch.Tensor]) -> tuple:
        return (tuple((id(full[s]), full[s].data_ptr(), full[s]._version) for s in self._sources),
                tuple((id(full[s]), full[s].data_ptr()) for s in self._states))

    def _comm(self, i: int, spec: InputSpec, device: torch.device) -> torch.Tensor:
        if i not in self._made:
            if spec.kind == "symmetric":
                t = self.allocator.allocate(spec.shape, spec.dtype)
            elif spec.kind == "peers":
                t = self.allocator.peer_pointers(self._comm(spec.of, self.sharded.inputs[spec.of], device))
            else:
                t = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            self._made[i] = (None, t)
        return self._made[i][1]

    def bind(self, full: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the sharded graph's arguments, the (full, shard) state pairs to ``write_back``)."""
        keys = self._keys(full)  # (the write-back leaves them as they are: it writes state sources only)
        if self._last is not None and self._last[0] == keys:
            args = list(self._last[1])
            for i, source in self._fulls:
                args[i] = full[source]
            return args, self._last[2]
        args, back = [], []
        device = next((a.device for a in full if isinstance(a, torch.Tensor)), torch.device("cpu"))
        for i, spec in enumerate(self.sharded.inputs):
            if spec.kind == "full":
                args.append(full[spec.source])
            elif spec.kind == "slice":
                src = full[spec.source]
                live = _live_state(spec, src) if spec.state else None
                if live is not None:
                    args.append(live)
                    continue
                key = (src.data_ptr(), src._version, tuple(src.shape))
                if spec.state and i in self._made:  # the same shard tensor: its address stays bound
                    if self._made[i][0][0] != src.data_ptr():
                        self._made[i] = (key, spec.take(src, self._made[i][1]))
                elif self._made.get(i, (None,))[0] != key:
                    self._made[i] = (key, spec.take(src))
                if spec.state:
                    back.append((src, self._made[i][1], spec))
                args.append(self._made[i][1])
            else:
                args.append(self._comm(i, spec, device))
        self._last = (keys, args, back, tuple(full[s] for s in self._sources + self._states))
        return args, back

    @staticmethod
    def write_back(back) -> None:
        """Copy each state shard the launch wrote back into the caller's full tensor."""
        for full, shard, spec in back:
            at = 0
            for a, b in spec.ranges:
                full.narrow(spec.dim, a, b - a).copy_(shard.narrow(spec.dim, at, b - a))
                at += b - a


def _live_state(spec: InputSpec, src: torch.Tensor) -> torch.Tensor | None:
    """The state input itself, or its rank slice as a view, when that is contiguous (the
    rank's shard, or a rank-local full-shaped tensor): the launch then writes the caller's
    memory directly. None when the shard must be copied."""
    if tuple(src.shape) == spec.shape:
        return src
    if len(spec.ranges) != 1:
        return None
    a, b = spec.ranges[0]
    view = src.narrow(spec.dim, a, b - a)
    return view if view.is_contiguous() else None


def rank_local(shape: Sequence[int], dim: int, lo: int, hi: int, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor of the full ``shape`` whose memory is only its slice [lo, hi) along
    ``dim`` (contiguous) and a little slack: the other indices of ``dim`` alias that memory.
    A rank binds its slice live (``RankBinder``), so a tensor-parallel rank's KV cache costs
    its share of memory and no copy a step. Only the slice may be read or written: an op over
    the whole tensor reads or writes the aliases too (PyTorch does not refuse the overlap)."""
    shape = tuple(int(n) for n in shape)
    if not (0 <= dim < len(shape) and 0 <= lo < hi <= shape[dim]):
        raise ValueError(f"slice [{lo}, {hi}) of dim {dim} of shape {shape}; expected 0 ≤ lo < hi ≤ shape[dim]")
    local = list(shape)
    local[dim] = hi - lo
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * local[i + 1]
    # the highest element either view reaches: the full view's (its dim runs past the slice's)
    # or the slice's, which starts lo rows in
    reach = max(sum((n - 1) * st for n, st in zip(shape, strides)),
                lo * strides[dim] + sum((n - 1) * st for n, st in zip(local, strides))) + 1
    return torch.zeros(reach, dtype=dtype, device=device).as_strided(shape, strides)


def sharded_runner(run: Callable[..., list[Any]], sharded: ShardedGraph, allocator: SymmetricAllocator):
    """``run`` (a runner of the sharded graph's arguments) as a runner of the full ones: binds
    each call's shards, writes state back, and returns the caller's full state tensor where an
    output is a state input (the KV cache the step returns)."""
    binder = RankBinder(sharded, allocator)
    state_out = {}
    for i, o in enumerate(sharded.graph.outputs):
        buf = sharded.graph.buffers[o.view.buffer] if o.view is not None else None
        if buf is not None and buf.role == "input" and sharded.inputs[buf.input_index].state:
            state_out[i] = sharded.inputs[buf.input_index].source

    def run_full(*full):
        args, back = binder.bind(full)
        out = list(run(*args))
        RankBinder.write_back(back)
        for i, src in state_out.items():
            out[i] = full[src]
        return out

    return run_full
