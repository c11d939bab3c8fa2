"""What an op kind needs from the CUDA code generator, kept with the kind (``OpDef.gpu``).

Codegen (mpk/executors/codegen.py) builds an ``OpInfo`` per op from the tables — its input
views, output, attrs and grid in plain Python values — and asks the kind's ``GpuSpec`` for the
op's parameters, its task (a function, or a template instantiation named per op), whether the
task opens its gate itself, its dynamic shared memory and the inputs it reads in 16-byte
vectors. The specs take only an ``OpInfo``, so mpk.ops needs nothing from the compiler or the
executors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mpk.errors import CompileError


@dataclass(frozen=True)
class ViewInfo:
    """One input view of an op: its shape, strides and offset in elements, its buffer's dtype,
    whether that buffer is a graph input (not computed in the graph) and whether the graph
    rewrites it for the next iteration (``carried``)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    buffer: int
    graph_input: bool
    # a graph input the graph rewrites for its next iteration (mpk.ops.iteration): read it only
    # after the task's gate has opened
    carried: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stride(self, d: int) -> int:
        """Stride of dim ``d``, 0 where the dim has size 1 (its stride is never used)."""
        return self.strides[d] if self.shape[d] > 1 else 0


@dataclass(frozen=True)
class OpInfo:
    """One op as codegen sees it (index ``index`` of the tables)."""

    index: int
    name: str
    kind: str
    attrs: dict[str, Any]
    inputs: tuple[ViewInfo, ...]
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    grid: tuple[int, ...]
    # the tables' code of a dtype (mpk.compiler.tables.DTYPE_CODE), as the CUDA tasks read it
    dtype_code: Callable[[torch.dtype], int] = field(repr=False, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.out_shape)

    def tile_extent(self, d: int) -> int:
        """The most elements of dim ``d`` a tile holds: the balanced split's ceiling."""
        return -(-self.out_shape[d] // self.grid[d])

    def error(self, message: str) -> CompileError:
        return CompileError(f"op {self.name!r}: {message}")


Params = tuple[list[int], list[float]]  # iparam, fparam


def no_params(op: OpInfo) -> Params:
    return [], []


@dataclass(frozen=True)
class GpuSpec:
    """A kind's CUDA side (cuda/mpk_tasks/*.cuh).

    * ``params``: the op's iparam / fparam (each task's header comment says what they hold);
    * ``task``: None — the kind's one task function ``mpk::task_<kind>``, which reads
      ``variant`` (below) at run time; or a function naming the template instantiation for an
      op (the generated dispatch switches over an op type's instantiations, so only those a
      graph uses are compiled). It checks what the template assumes, raising CompileError;
    * ``variant``: the run-time variant of a ``task_<kind>`` (0 when None);
    * ``self_gated``: the task opens its gate itself (acquire_inputs), after the loads that need
      nothing the graph computes; else the dispatch waits for the gate first;
    * ``float64_exact``: the task keeps float64 exact (the rest compute in float32);
    * ``smem_bytes``: the dynamic shared memory an op's tasks need (the launch takes the largest);
    * ``vector_inputs``: the inputs its task reads with 16-byte vector loads (their graph-input
      buffers must be 16-byte aligned);
    * ``check``: raises CompileError where the task cannot run the op at all;
    * ``slow_path``: why the op runs a path far slower than the kind's best, where that matters
      (a model-sized projection on the general matmul task), as "(what, which): why"; else None;
    * ``in_kernel``: the op's task must be compiled into the kernel function itself, not into a
      function it calls (warpgroup MMAs: ptxas serializes them inside a called function), so a
      graph holding such an op gets its task dispatch inlined into the kernel.
    """

    params: Callable[[OpInfo], Params] = no_params
    task: Callable[[OpInfo], str] | None = None
    variant: Callable[[OpInfo], int] | None = None
    self_gated: bool = False
    float64_exact: bool = False
    smem_bytes: Callable[[OpInfo], int] | None = None
    vector_inputs: Callable[[OpInfo], tuple[int, ...]] | None = None
    check: Callable[[OpInfo], None] | None = None
    slow_path: Callable[[OpInfo], str | None] | None = None
    in_kernel: Callable[[OpInfo], bool] | None = None


# --- helpers shared by the specs ---------------------------------------------------------------

CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}  # the typed tasks' floats
DTYPE_SIZE = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
# every dtype's C type (common.cuh's load_f / load_i switch over the same codes)
ELEMENT_CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16",
                  torch.float64: "double", torch.int64: "long long", torch.int32: "int", torch.int16: "short",
                  torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool"}
INDEX_CTYPES = {torch.int32: "int", torch.int64: "long long"}


def all_inputs(op: OpInfo) -> tuple[int, ...]:
    return tuple(range(len(op.inputs)))


def one_ctype(op: OpInfo, views: list[ViewInfo], with_output: bool) -> str:
    """The C++ type shared by ``views`` (and the op's output): the typed paged tasks take one."""
    dtypes = {v.dtype for v in views} | ({op.out_dtype} if with_output else set())
    if len(dtypes) != 1 or next(iter(dtypes)) not in CTYPES:
        raise op.error(f"the CUDA task needs its tensors in one dtype among "
                       f"{sorted(str(d).removeprefix('torch.') for d in CTYPES)}; got dtype codes "
                       f"{sorted(op.dtype_code(d) for d in dtypes)} (mpk.compiler.tables.DTYPES)")
    return CTYPES[next(iter(dtypes))]


def check_contiguous(op: OpInfo, what: str, view: ViewInfo, vec: int) -> None:
    """A view read along its last dim in vectors of ``vec`` elements: unit stride, and every
    other stride and the offset multiples of ``vec`` (with a 16-byte aligned base, each vector
    is then aligned to its size)."""
    strides = list(view.strides)
    if strides[-1] != 1 or view.offset % vec or any(x % vec for x in strides[:-1]):
        raise op.error(f"{what} must be contiguous along its last dim with offset and strides multiples of {vec} "
                       f"elements; got offset {view.offset}, strides {strides}")


def index_ctype(op: OpInfo, views: list[ViewInfo]) -> str:
    """The C++ type of a paged op's page table (kv_indptr, kv_indices, kv_last_page_len: one of
    int32 / int64, shared by the three), which its task reads without a per-element dtype switch."""
    dtypes = {v.dtype for v in views}
    if len(dtypes) != 1 or next(iter(dtypes)) not in INDEX_CTYPES:
        names = sorted(str(d).removeprefix("torch.") for d in dtypes)
        raise op.error(f"kv_indptr, kv_indices and kv_last_page_len must share one dtype, int32 or int64; got {names}")
    return INDEX_CTYPES[next(iter(dtypes))]


def float_bits(v: float) -> int:
    """A number's float64 bits, as the CUDA side reads them back (__longlong_as_double)."""
    import struct

    return struct.unpack("<q", struct.pack("<d", float(v)))[0]
