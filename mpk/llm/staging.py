"""``PinnedWriter``: a step's small host-made inputs (the page table, the token ids) written into
their fixed device tensors without stalling the host or allocating."""

from __future__ import annotations

import numpy as np
import torch


class PinnedWriter:
    """Writes host arrays into ``dst`` (a contiguous tensor whose address stays fixed) as
    ``host()`` → fill → ``flush()``.

    On the GPU the array is pinned staging and ``flush`` copies it asynchronously: a blocking
    copy would wait for the steps still queued on the stream (decode loops run ``sync=False``).
    Two staging slots alternate; a slot is refilled only once its previous copy ran (an event,
    done long before in a step loop), so nothing is allocated or pinned per write. On the CPU
    ``host()`` is ``dst`` itself and ``flush`` does nothing."""

    SLOTS = 2

    def __init__(self, dst: torch.Tensor):
        if not dst.is_contiguous():
            raise ValueError(f"PinnedWriter needs a contiguous destination; got strides {dst.stride()}")
        self.dst = dst
        self._slots = [torch.empty_like(dst, device="cpu").pin_memory() for _ in range(self.SLOTS)] if dst.is_cuda \
            else []
        # a meta destination (graphs traced to build their kernels, nothing run): a host array to
        # write, which nothing reads
        self._scratch = torch.empty_like(dst, device="cpu") if dst.is_meta else dst
        self._done: list[torch.cuda.Event | None] = [None] * len(self._slots)
        self._i = 0

    def host(self) -> np.ndarray:
        """The array the next ``flush`` writes (its contents are the previous use's: write every
        element that matters)."""
        if not self._slots:
            return self._scratch.numpy()
        done = self._done[self._i]
        if done is not None:
            done.synchronize()
        return self._slots[self._i].numpy()

    def flush(self) -> None:
        """Queue the copy of ``host()``'s array into ``dst`` on the current stream."""
        if not self._slots:
            return
        self.dst.copy_(self._slots[self._i], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.dst.device))
        self._done[self._i] = done
        self._i = (self._i + 1) % self.SLOTS
