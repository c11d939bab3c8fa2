"""OpGraph: the frontend's output and the compiler's input.

Buffers are contiguous tensors (graph inputs or op outputs); every op writes exactly one fresh
buffer, whole, and reads its inputs through zero-copy ``View``s of buffers. Ops are data: a
``kind`` naming an entry of the op registry (``mpk.ops``) plus JSON-able ``attrs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mpk.ir.views import Shape, View


@dataclass
class Buffer:
    id: int
    name: str
    shape: Shape
    dtype: torch.dtype
    role: str  # "input" (bound from the caller's arguments) or "intermediate" (an op's output)
    input_index: int | None = None
    is_param: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Op:
    id: int
    kind: str
    inputs: tuple[View, ...]
    output: int
    attrs: dict[str, Any]
    name: str
    source: str = ""  # user source line the op came from, for messages
    partition: tuple[int, ...] | None = None  # tiles per output dim, set by the compiler


@dataclass
class GraphOutput:
    """A graph output: a view of a buffer, or a plain Python value (None, an int, …)."""

    view: View | None = None
    value: Any = None


@dataclass
class OpGraph:
    buffers: list[Buffer] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    outputs: list[GraphOutput] = field(default_factory=list)

    def add_buffer(self, name: str, shape: Shape, dtype: torch.dtype, role: str, **kw) -> Buffer:
        buf = Buffer(len(self.buffers), name, tuple(int(s) for s in shape), dtype, role, **kw)
        self.buffers.append(buf)
        return buf

    def add_op(self, kind: str, inputs: tuple[View, ...], out_shape: Shape, out_dtype: torch.dtype,
               attrs: dict[str, Any], name: str, source: str = "") -> Op:
        out = self.add_buffer(name, out_shape, out_dtype, "intermediate")
        op = Op(len(self.ops), kind, tuple(inputs), out.id, dict(attrs), name, source)
        self.ops.append(op)
        return op

    @property
    def inputs(self) -> list[Buffer]:
        return sorted((b for b in self.buffers if b.role == "input"), key=lambda b: b.input_index)

    def describe(self) -> str:
        lines = [f"OpGraph: {len(self.buffers)} buffers, {len(self.ops)} ops"]
        for op in self.ops:
            ins = ", ".join(f"{self.buffers[v.buffer].name}{list(v.shape)}" for v in op.inputs)
            out = self.buffers[op.output]
            lines.append(f"  {op.name:24s} {op.kind:12s} ({ins}) -> {list(out.shape)} {str(out.dtype)[6:]}")
        return "\n".join(lines)
