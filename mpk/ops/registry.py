"""The op registry: every op kind mpk knows, as data.

An ``OpDef`` says, for one kind, everything the later stages need and nothing about FX:

* ``splittable``: which output dims a tile may split (the rest are reduced over / needed whole);
* ``input_regions``: for an output tile, the rect of each input view it reads (None: not read);
* ``cpu``: the tile computed with PyTorch from exactly those input slices (the CPU
  interpreter passes nothing else, so a kernel cannot read outside its declared regions);
* partition hints (``split_order``, ``min_tile_elems``, ``long_tasks``, ``default_grid``) and
  ``data_dependent`` (JIT launch);
* ``gpu``: what the CUDA code generator needs (mpk.ops.gpu.GpuSpec: parameters, task or
  template instantiation, gating, shared memory, vector loads).

Both the compiler and the executors read op kinds through this registry; the tables carry the
kind's ``type_id`` and the op's attrs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mpk.ir.regions import Rect
from mpk.ops.gpu import GpuSpec
from mpk.ir.views import Shape


@dataclass(frozen=True)
class OpSig:
    """What an op looks like from the outside: input/output shapes, output dtype, attrs."""

    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    out_dtype: torch.dtype
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)


def _all_dims(sig: OpSig) -> tuple[bool, ...]:
    return tuple(True for _ in sig.out_shape)


def _largest_first(sig: OpSig) -> list[int]:
    return sorted(range(len(sig.out_shape)), key=lambda d: (-sig.out_shape[d], d))


@dataclass(frozen=True)
class OpDef:
    kind: str
    type_id: int
    input_regions: Callable[[OpSig, Rect], list[Rect | None]]
    cpu: Callable[[OpSig, Rect, list[torch.Tensor | None]], torch.Tensor]
    splittable: Callable[[OpSig], tuple[bool, ...]] = _all_dims
    split_order: Callable[[OpSig], list[int]] = _largest_first
    # default partitioning keeps tiles at least this large (output elements; a function of the
    # op's signature where the work per element varies, as a reduction's row length)
    min_tile_elems: int | Callable[[OpSig], int] = 1024
    # the kind's own default grid over (sig, workers) where the split above does not suit its task
    # (a tensor-core matmul: whole MMA tiles in both output dims); None from it: the split above
    default_grid: Callable[[OpSig, int], tuple[int, ...] | None] | None = None
    data_dependent: bool = False
    # its tasks take several µs however small their tile (a chain of dependent loads: paged
    # attention), so a narrow op of this kind holds its workers long (partition.py)
    long_tasks: bool = False
    # a tile's work relative to the op's other tiles, where it varies (causal attention rows: with
    # their position); placement deals such an op's tasks to the least loaded workers instead of
    # round-robin (mpk.compiler.place). None, or NaN for a signature: alike.
    tile_cost: Callable[[OpSig, Rect], float] | None = None
    gpu: GpuSpec | None = None  # None: no CUDA task (codegen refuses the kind)
    doc: str = ""
    # What a tile writes into its inputs in place (graph inputs: the KV-cache append), as
    # (input index, rect) pairs: a rect of the input view, or of its key space when
    # ``key_spaces`` names one for that input. The compiler's happens-before check
    # (mpk.compiler.verify) and the interpreter's race tracking read it; dependency analysis
    # does not, so the op must be ordered after such a write by what else it reads.
    inplace_writes: Callable[[OpSig, Rect], list[tuple[int, Rect]]] | None = None
    # What a tile writes into its inputs for the *next* iteration of a launch (the
    # start-of-iteration task, mpk.ops.iteration), as (input index, rect of the input view):
    # every other task of the iteration that touches those elements must finish before the
    # writer starts (the happens-before check verifies it; the interpreter reports a read of an
    # element after its next-iteration value was written). Readers in the next iteration are
    # ordered by the end event.
    carried_writes: Callable[[OpSig, Rect], list[tuple[int, Rect]]] | None = None
    key_spaces: Callable[[OpSig], list["KeySpace"]] | None = None
    # A tile that waits on run-time data before it may run (a collective's reduce: its peers'
    # signals): given the slices ``cpu`` would get, None when it may run, else what it waits
    # for. The CPU interpreter runs only tiles whose wait is None; the CUDA task spins itself.
    wait: Callable[[OpSig, Rect, list[torch.Tensor | None]], str | None] | None = None


@dataclass(frozen=True)
class KeySpace:
    """Coordinates for an input a tile addresses through run-time data (the paged KV cache: the
    page table picks page and slot), where no rect of the input says which elements a tile
    touches. The op's reads and in-place writes of that input are rects of ``shape`` instead
    (``reads``: the rect a tile reads, None: nothing). Keys must reach distinct elements for
    every input the op accepts, and every op addressing one buffer this way must use the same
    space; any plain access to that buffer counts as touching the whole space."""

    input: int
    shape: Shape
    dims: tuple[str, ...]
    reads: Callable[[OpSig, Rect], Rect | None]


REGISTRY: dict[str, OpDef] = {}
_BY_TYPE_ID: dict[int, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.kind in REGISTRY or opdef.type_id in _BY_TYPE_ID:
        raise ValueError(f"op kind {opdef.kind!r} / type id {opdef.type_id} registered twice")
    REGISTRY[opdef.kind] = opdef
    _BY_TYPE_ID[opdef.type_id] = opdef
    return opdef


def min_tile_elems(opdef: OpDef, sig: OpSig) -> int:
    """The smallest tile (output elements) default partitioning gives an op of ``opdef``."""
    m = opdef.min_tile_elems
    return m(sig) if callable(m) else m


def get_op(kind: str) -> OpDef:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise KeyError(f"unknown op kind {kind!r}; known: {sorted(REGISTRY)}") from None


def op_by_type_id(type_id: int) -> OpDef:
    return _BY_TYPE_ID[type_id]


# --- region helpers shared by op kinds ---------------------------------------------------------

def broadcast_region(in_shape: Shape, out_shape: Shape, rect: Rect) -> Rect:
    """Rect of a right-aligned broadcast input read by output ``rect``."""
    lead = len(out_shape) - len(in_shape)
    return tuple((0, 1) if n == 1 and out_shape[lead + i] != 1 else rect[lead + i]
                 for i, n in enumerate(in_shape))


def rows_region(in_shape: Shape, out_shape: Shape, rect: Rect) -> Rect:
    """Broadcast read of the leading dims, whole last dim (row-wise ops)."""
    return broadcast_region(in_shape[:-1], out_shape[:-1], rect[:-1]) + ((0, in_shape[-1]),)


def all_but_last(sig: OpSig) -> tuple[bool, ...]:
    return tuple(d != len(sig.out_shape) - 1 for d in range(len(sig.out_shape)))
