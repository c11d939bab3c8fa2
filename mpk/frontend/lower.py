"""FX (functionalized ATen, parameters lifted) → OpGraph.

Nodes are visited in order; a rule from ``rules.HANDLERS`` turns each ATen call into
either a new ``View`` of an existing buffer (view ops: no data moves) or an op of the registry
writing a fresh buffer. A view that has no strided form is materialised by a ``copy`` op the
moment an op or a graph output consumes it.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from mpk.errors import UnsupportedOpError
from mpk.frontend.rules import lookup, no_rule_reason
from mpk.frontend.values import Unavailable, Unsupported, refuse_unavailable
from mpk.ir.opgraph import GraphOutput, OpGraph
from mpk.ir.views import View, identity_view

NAMED_BY_KIND = ("attention", "rms_norm", "rope", "silu_mul", "layer_norm", "softmax", "rope_append", "attn_partial",
                 "attn_merge")


def source_line(node: Node) -> str:
    """The innermost user source location recorded for ``node`` ('file:line: code')."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            where = lines[i][5:].replace('"', "").replace(", line ", ":").split(", in ")[0]
            return f"{where}: {code}" if code else where
    # torch's own modules (an nn.Sequential's layers) record no trace: name the module instead
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        path = re.sub(r"^L\['(fn|self)'\]", "model", str(path))
        return f"module {path} ({getattr(cls, '__name__', cls)}; no source line recorded)"
    return "<unknown source: no stack trace recorded>"


def describe_inputs(node: Node) -> str:
    parts = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        parts.append(f"{tuple(v.shape)} {str(v.dtype)[6:]}" if isinstance(v, torch.Tensor) else type(v).__name__)
    return "[" + ", ".join(parts) + "]"


def op_name(target) -> str:
    return str(getattr(target, "_name", None) or getattr(target, "__name__", target))


class Lowering:
    """One lowering run. In probe mode unsupported nodes are recorded instead of raised and
    their outputs become opaque inputs, so one pass finds every unsupported node."""

    def __init__(self, gm: GraphModule, param_flags: list[bool] | None = None,
                 input_names: list[str] | None = None, probe: bool = False, fuse_rope_attention: bool = True,
                 num_workers: int = 128):
        self.gm, self.probe, self.fuse_rope_attention = gm, probe, fuse_rope_attention
        self.num_workers = num_workers  # what op choices sized to one wave of tasks count on
        self.param_flags, self.input_names = param_flags, input_names
        self.graph = OpGraph()
        self.env: dict[Node, Any] = {}
        self.failures: list[tuple[Node, str]] = []
        self._node: Node | None = None
        self._n_inputs = 0
        self._materialized: dict[View, View] = {}
        # (cache buffer, layer) -> buffer of the rotated q that rope_append wrote for that layer
        # (attention over the layer must read this q, which is what orders it after the append),
        # or the DeferredRope that the layer's attention runs inside its own tasks
        self.appended_q: dict[tuple[int, int], Any] = {}
        self.attended: set[tuple[int, int]] = set()  # (cache buffer, layer) some attention read
        self.shared: dict[tuple, View] = {}  # what rules emit once per graph, by key (the attention plan)

    # --- helpers for handlers -------------------------------------------------------------
    def meta(self, node: Node | None = None) -> torch.Tensor:
        val = (node or self._node).meta.get("val")
        if isinstance(val, (tuple, list)):
            val = val[0]
        if not isinstance(val, torch.Tensor):
            raise Unsupported("the node has no tensor metadata")
        return val

    def strided(self, view: View) -> View:
        """The view itself if it has a strided form; else the chain is cut at the first reshape
        without one, the part before it is copied (reshaped) into a fresh buffer, and the rest
        of the chain is applied to that buffer."""
        if view.strided() is not None:
            return view
        if view in self._materialized:
            return self._materialized[view]
        k = next(i for i in range(1, len(view.steps) + 1)
                 if View(view.buffer, view.base_shape, view.steps[:i], view.shapes[:i]).strided() is None) - 1
        rest = self.copy(View(view.buffer, view.base_shape, view.steps[:k], view.shapes[:k]), view.shapes[k])
        for step in view.steps[k + 1:]:
            rest = rest.then(step)
        self._materialized[view] = self.strided(rest)
        return self._materialized[view]

    def copy(self, view: View, shape: tuple[int, ...] | None = None) -> View:
        """``view``'s elements copied, row-major, into a fresh buffer of its shape or of
        ``shape`` (a reshape of it: the copy op materialises ``reshape(view, shape)``)."""
        src, shape = self.graph.buffers[view.buffer], view.shape if shape is None else tuple(shape)
        op = self.graph.add_op("copy", (self.strided(view),), shape, src.dtype, {}, self._unique(f"{src.name}_copy"),
                               source_line(self._node) if self._node else "")
        return identity_view(op.output, shape)

    def emit(self, kind: str, inputs: list[View], attrs: dict[str, Any] | None = None,
             shape=None, dtype: torch.dtype | None = None) -> View:
        """Add an op of ``kind`` for the current node; output shape/dtype default to its metadata."""
        val = self.meta() if shape is None or dtype is None else None
        shape = tuple(val.shape) if shape is None else tuple(shape)
        dtype = val.dtype if dtype is None else dtype
        ins = tuple(self.strided(v) for v in inputs)
        # Fused and attention ops are named by kind: their FX names are long and say less.
        base = kind if kind in NAMED_BY_KIND else self._node.name
        op = self.graph.add_op(kind, ins, shape, dtype, attrs or {}, self._unique(base), source_line(self._node))
        return identity_view(op.output, shape)

    def _unique(self, name: str) -> str:
        taken = {b.name for b in self.graph.buffers}
        if name not in taken:
            return name
        k = 1
        while f"{name}_{k}" in taken:
            k += 1
        return f"{name}_{k}"

    # --- the walk -----------------------------------------------------------------------
    def _input(self, node: Node, name: str, is_param: bool):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedOpError(
                f"graph input {node.name!r} is {type(val).__name__}, expected a tensor with static "
                "shape; mpk compiles static shapes only: use torch.compile(..., dynamic=False)")
        if any(not isinstance(s, int) for s in val.shape):
            raise UnsupportedOpError(
                f"graph input {node.name!r} has a symbolic shape {tuple(val.shape)}; mpk compiles "
                "static shapes only: use torch.compile(..., dynamic=False)")
        buf = self.graph.add_buffer(name, tuple(val.shape), val.dtype, "input",
                                    input_index=self._n_inputs, is_param=is_param)
        self._n_inputs += 1
        return identity_view(buf.id, buf.shape)

    def _opaque(self, node: Node):
        """Probe mode: stand-in for the output of an unsupported node."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            buf = self.graph.add_buffer(node.name, tuple(val.shape), val.dtype, "opaque")
            return identity_view(buf.id, buf.shape)
        if isinstance(val, (tuple, list)):
            return tuple(self._opaque_value(v, node.name) for v in val)
        return Unavailable(f"output of unsupported {node.name}")

    def _opaque_value(self, v, name):
        if isinstance(v, torch.Tensor):
            buf = self.graph.add_buffer(name, tuple(v.shape), v.dtype, "opaque")
            return identity_view(buf.id, buf.shape)
        return Unavailable(name)

    def run(self) -> OpGraph:

        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            name = self.input_names[i] if self.input_names and i < len(self.input_names) else node.name
            flag = bool(self.param_flags and i < len(self.param_flags) and self.param_flags[i])
            self.env[node] = self._input(node, name, flag)
        for node in self.gm.graph.nodes:
            self._node = node
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self._outputs(node)
                continue
            if node.op == "get_attr":
                # torch.compile's path lifts these into inputs first (fx_pipeline.lift_constants)
                self._fail(node, "a tensor constant made inside forward (torch.tensor(...) there, or a list index "
                                 "such as x[:, [i]]) in a graph whose constants were not lifted into inputs: "
                                 "call mpk.fx_pipeline.lift_constants on the graph first")
                continue
            if node.op != "call_function":
                self._fail(node, f"FX node kind {node.op!r} (only call_function is lowered)")
                continue
            args = map_arg(node.args, lambda n: self.env[n])
            kwargs = map_arg(node.kwargs, lambda n: self.env[n])
            handler = lookup(node.target)
            try:
                if handler is None:
                    raise Unsupported(no_rule_reason(node.target))
                # getitem may pick a computed element out of a tuple holding Unavailable ones;
                # elementwise rules take a ScalarConst as a constant
                if node.target is not operator.getitem:
                    refuse_unavailable(_flat(args, kwargs), getattr(handler, "takes_scalars", False))
                self.env[node] = handler(self, node, *args, **kwargs)
            except Unsupported as exc:
                self._fail(node, str(exc))
        return self.graph

    def _fail(self, node: Node, reason: str):
        if not self.probe:
            raise UnsupportedOpError(
                f"mpk cannot lower {op_name(node.target)} (node {node.name!r}): {reason}. "
                f"Inputs: {describe_inputs(node)}. Source: {source_line(node)}. "
                "Pass options={'fallback': 'eager'} to run unsupported parts in PyTorch.")
        self.failures.append((node, reason))
        self.env[node] = self._opaque(node)

    def _outputs(self, node: Node):
        for src in _flat(node.args[0], {}):
            value = self.env[src] if isinstance(src, Node) else src
            if isinstance(value, View):
                self.graph.outputs.append(GraphOutput(view=self.strided(value)))
            elif isinstance(value, Unavailable):
                # blamed on the op that would have to compute it (not the getitem picking it, nor
                # the output node), so that fallback='eager' runs that op in PyTorch
                while isinstance(src, Node) and src.target is operator.getitem:
                    src = src.args[0]
                self._fail(src if isinstance(src, Node) else node,
                           f"a graph output is {value.what}, which mpk does not compute")
            else:
                self.graph.outputs.append(GraphOutput(value=value))


def _flat(args, kwargs) -> list:
    out: list = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        else:
            out.append(x)

    walk(args)
    walk(kwargs)
    return out


def lower(gm: GraphModule, param_flags: list[bool] | None = None,
          input_names: list[str] | None = None, fuse_rope_attention: bool = True,
          num_workers: int = 128) -> OpGraph:
    """Lower a fully supported FX graph; raises ``UnsupportedOpError`` on the first bad node.
    ``fuse_rope_attention``: a rope_append whose q only paged attention reads becomes part of
    the attention op (rope_attn_partial). ``num_workers``: the workers the graph will run on
    (paged attention's default KV chunk count is sized to them)."""
    return Lowering(gm, param_flags, input_names, fuse_rope_attention=fuse_rope_attention,
                    num_workers=num_workers).run()


def find_unsupported(gm: GraphModule, fuse_rope_attention: bool = True) -> list[tuple[Node, str]]:
    """Every node mpk cannot lower, with the reason, in one pass (``lower``'s options)."""
    lowering = Lowering(gm, probe=True, fuse_rope_attention=fuse_rope_attention)
    lowering.run()
    return lowering.failures
