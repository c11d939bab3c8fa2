"""Inspection: compile a module without running it, report the task graph, write DOT/SVG/JSON.

``compile_module(model, args)`` traces as the ``torch.compile`` backend does (Dynamo and
AOTAutograd; works on meta tensors, so models larger than host memory can be inspected) and
runs the same frontend and compiler on the same graph, without running it.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from mpk.compiler import CompiledGraph
from mpk.compiler.tables import FLAG_BARRIER, FLAG_JIT
from mpk.errors import MpkError, OptionError, UnsupportedOpError
from mpk.fx_pipeline import compile_tables, trace_inference, unsupported_report
from mpk.options import CompileOptions


class _Traced(Exception):
    """Raised by compile_module's graph instead of running it."""


def compile_module(model: torch.nn.Module, args: Sequence[Any],
                   options: Mapping[str, Any] | None = None) -> CompiledGraph:
    """Trace ``model(*args)`` as ``torch.compile(model, backend="mpk", fullgraph=True)`` does
    and compile it to tables, running nothing: the graph the backend would run. ``options`` as
    for torch.compile; ``debug_dir`` dumps the graph there (``dump``). The whole graph must
    lower: an unsupported op is an ``UnsupportedOpError`` listing every one, and
    ``fallback='eager'`` (parts run in PyTorch) has nothing to run here and is refused. The
    happens-before check (mpk.compiler.verify) runs with ``verify=True``; its report is
    ``stats.verified``."""
    from torch._dynamo.eval_frame import remove_from_cache
    from torch._dynamo.exc import BackendCompilerFailed

    opts = CompileOptions.parse(dict(options or {}, executor="cpu"))
    if opts.fallback != "error":
        raise OptionError(f"fallback={opts.fallback!r}: compile_module (mpk inspect) builds one graph to inspect "
                          "and runs nothing, so no part of it can fall back to PyTorch; expected 'error'")
    found: list[CompiledGraph] = []

    def fw_compiler(gm, flags, names):
        compiled = compile_tables(gm, opts, flags, names, check=opts.verify)
        if not isinstance(compiled, CompiledGraph):
            raise UnsupportedOpError(unsupported_report(compiled) + "\nmpk inspect needs the whole graph lowered.")
        found.append(compiled)
        return gm

    def backend(gm, example_inputs):
        trace_inference(gm, example_inputs, fw_compiler)

        def stop(*_):
            raise _Traced

        return stop

    # Dynamo caches what it compiled on the forward's code object, which every instance of the
    # class shares: the capture traces a shallow copy of the model whose forward runs the same
    # code from a fresh code object, so it is never a cache hit and leaves the caller's own
    # compiled models alone (dropping the class's cache, as torch._dynamo.export does, would
    # make them recompile).
    fwd = type(model).forward
    traced = model
    if isinstance(fwd, types.FunctionType):
        fresh = types.FunctionType(fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__,
                                   fwd.__closure__)
        fresh.__kwdefaults__ = fwd.__kwdefaults__
        traced = copy.copy(model)
        traced.forward = types.MethodType(fresh, traced)
    else:
        remove_from_cache(model)
    try:
        with torch.no_grad():
            torch.compile(traced, backend=backend, fullgraph=True, dynamic=False)(*args)
    except _Traced:
        pass
    except BackendCompilerFailed as e:
        if isinstance(e.inner_exception, MpkError):
            raise e.inner_exception from None
        raise
    finally:
        remove_from_cache(traced.forward if traced is not model else model)
    if not found:  # Dynamo ran the model instead of tracing it (TORCHDYNAMO_DISABLE=1, say)
        raise MpkError("torch.compile did not trace the model (is Dynamo disabled, e.g. TORCHDYNAMO_DISABLE=1?); "
                       "compile_module needs its graph")
    compiled = found[0]
    if opts.debug_dir:
        dump(compiled, opts.debug_dir)
    return compiled


def to_json(compiled: CompiledGraph) -> dict:
    t = compiled.tables
    return {
        "meta": t.meta,
        "stats": {k: v for k, v in vars(compiled.stats).items()},
        "tasks": [{"id": i, "op": int(r["op"]), "tile": int(r["tile"]), "dep_event": int(r["dep_event"]),
                   "trig_event": int(r["trig_event"]), "jit": bool(r["flags"] & FLAG_JIT)}
                  for i, r in enumerate(t.tasks)],
        "events": [{"id": i, "num_triggers": int(r["num_triggers"]), "launches": [int(r["first_task"]),
                    int(r["last_task"])], "barrier": bool(r["flags"] & FLAG_BARRIER)}
                   for i, r in enumerate(t.events)],
    }


def to_dot(compiled: CompiledGraph, max_tasks: int = 3000) -> str:
    """The task graph: tasks (boxes, one cluster per op; JIT ones orange, dummies grey) and
    events (diamonds; barriers double). Past ``max_tasks`` tasks, one node per op instead."""
    t = compiled.tables
    ops = t.meta["ops"]
    lines = ["digraph mpk {", "  rankdir=TB; node [fontsize=9]; edge [arrowsize=0.5];",
             '  labelloc=b; fontsize=10; label="tasks: blue AOT, orange JIT, grey dummy; '
             'events: diamonds (×num_triggers), double circles = global barriers";']
    if len(t.tasks) <= max_tasks:
        by_op: dict[int, list[int]] = {}
        for i, r in enumerate(t.tasks):
            by_op.setdefault(int(r["op"]), []).append(i)
        for op, ids in sorted(by_op.items()):
            label = ops[op]["name"] if op >= 0 else "dummy tasks"
            lines.append(f'  subgraph cluster_op{op + 1} {{ label="{label}"; style=rounded;')
            for i in ids:
                r = t.tasks[i]
                color = "grey80" if op < 0 else ("orange" if r["flags"] & FLAG_JIT else "lightblue")
                lines.append(f'    t{i} [shape=box style=filled fillcolor={color} label="t{i}"];')
            lines.append("  }")
        for e, r in enumerate(t.events):
            shape = "doublecircle" if r["flags"] & FLAG_BARRIER else "diamond"
            lines.append(f'  e{e} [shape={shape} label="e{e}\\n×{int(r["num_triggers"])}"];')
            for i in range(int(r["first_task"]), int(r["last_task"])):
                lines.append(f"  e{e} -> t{i};")
        for i, r in enumerate(t.tasks):
            lines.append(f"  t{i} -> e{int(r['trig_event'])};")
    else:
        tg = compiled.taskgraph
        prod_op = {tg.graph.ops[x.op_id].output: x.op_id for x in tg.tiles}
        for x in tg.tiles:
            op = tg.graph.ops[x.op_id]
            lines.append(f'  op{op.id} [shape=box label="{op.name}\\n{op.kind} ×{x.num_tasks}"];')
            for v in op.inputs:
                if v.buffer in prod_op:
                    lines.append(f"  op{prod_op[v.buffer]} -> op{op.id};")
    lines.append("}")
    return "\n".join(lines)


def dump(compiled: CompiledGraph, directory: str | Path, stem: str = "graph") -> dict[str, Path]:
    """Write summary, OpGraph, tables, JSON, DOT (and SVG if graphviz's ``dot`` is installed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary": d / f"{stem}.summary.txt",
        "opgraph": d / f"{stem}.opgraph.txt",
        "tables": d / f"{stem}.tables",
        "json": d / f"{stem}.json",
        "dot": d / f"{stem}.dot",
    }
    paths["summary"].write_text(compiled.stats.summary() + "\n")
    paths["opgraph"].write_text(compiled.graph.describe() + "\n")
    paths["tables"].write_bytes(compiled.tables.to_bytes())
    paths["json"].write_text(json.dumps(to_json(compiled), indent=1, default=str))
    paths["dot"].write_text(to_dot(compiled))
    if shutil.which("dot"):
        svg = d / f"{stem}.svg"
        subprocess.run(["dot", "-Tsvg", str(paths["dot"]), "-o", str(svg)], check=True, timeout=300)
        paths["svg"] = svg
    return paths
