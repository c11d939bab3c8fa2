"""The ``torch.compile`` backend: Dynamo graph → AOTAutograd (functionalized ATen, parameters
lifted, inference) → pattern fusion → OpGraph → tables → an executor.

Registered as the ``mpk`` entry point of ``torch_dynamo_backends``, so
``torch.compile(model, backend="mpk")`` works without importing mpk.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx import GraphModule
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from mpk.compiler import CompiledGraph, compile_graph
from mpk.errors import MpkError, UnsupportedOpError
from mpk.frontend import find_unsupported, fuse_patterns, lower
from mpk.frontend.patterns import route_attention
from mpk.frontend.lower import describe_inputs, op_name, source_line
from mpk.inspection import dump, pretty_input_name
from mpk.options import CompileOptions

# Every CompiledGraph built in this process, newest last (inspection and tests read it), and
# the runner made for each (by id of the CompiledGraph) while something else (the compiled
# model) keeps it alive: a runner holds its executor's GPU buffers and last arguments.
COMPILED: list[CompiledGraph] = []
RUNNERS: weakref.WeakValueDictionary[int, Callable] = weakref.WeakValueDictionary()


def mpk_backend(gm: GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None):
    """Dynamo backend entry point (``torch.compile(model, backend="mpk", options={...})``)."""
    opts = CompileOptions.parse(options)
    return trace_inference(gm, example_inputs, lambda fx_gm, flags, names: compile_fx(fx_gm, opts, flags, names))


def trace_inference(gm: GraphModule, example_inputs: Sequence[Any],
                    fw_compiler: Callable[[GraphModule, list[bool] | None, list[str] | None], Callable]) -> Callable:
    """A Dynamo graph → the functionalized ATen graph mpk compiles: SDPA kept whole, AOTAutograd
    (parameters lifted, inference only). ``fw_compiler(aten_gm, param_flags, input_names)``
    compiles it (flags and names are None where AOTAutograd's inputs differ from Dynamo's)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*gm.parameters(), *example_inputs]
                                       if isinstance(t, torch.Tensor)):
        # refused here, not by the backward compiler below: AOTAutograd would first trace a
        # backward through mpk's custom ops (an internal error) or make the forward also return
        # what backward saves (a layer norm's mean and rstd, which mpk does not compute)
        _no_training(gm, example_inputs)
    route_attention(gm)
    dynamo_inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lifted = [name for name, _ in gm.named_parameters()] + [name for name, _ in gm.named_buffers()]
    names = lifted + [pretty_input_name(str(n.target)) for n in dynamo_inputs]
    flags = [True] * len(lifted) + [isinstance(x, torch.nn.Parameter) for x in example_inputs]

    def fw(fx_gm: GraphModule, fw_inputs):
        n_in = sum(1 for n in fx_gm.graph.nodes if n.op == "placeholder")
        same = n_in == len(names)
        return fw_compiler(fx_gm, flags if same else None, names if same else None)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=_no_training)


def _no_training(gm, example_inputs):
    raise MpkError("mpk compiles inference graphs only: call the compiled model under torch.no_grad() "
                   "or torch.inference_mode() (to train, run the model in eager PyTorch)")


def unsupported_report(failures) -> str:
    lines = [f"mpk cannot lower {len(failures)} node(s):"]
    for node, reason in failures:
        lines.append(f"  - {op_name(node.target)} (node {node.name!r}): {reason}; inputs "
                     f"{describe_inputs(node)}; source {source_line(node)}")
    return "\n".join(lines)


def compile_tables(gm: GraphModule, opts: CompileOptions, param_flags: list[bool] | None = None,
                   input_names: list[str] | None = None) -> CompiledGraph | list:
    """Pattern fusion, lowering and the compiler on one functionalized ATen graph: its
    CompiledGraph, or the nodes that cannot lower as (node, reason) pairs."""
    fuse_patterns(gm, opts.optional_fusions(), opts.partition_workers)
    failures = find_unsupported(gm, opts.fuse_rope_attention)
    if failures:
        return failures
    graph = lower(gm, param_flags, input_names, opts.fuse_rope_attention, opts.partition_workers)
    return compile_graph(graph, opts.partition_workers, opts.partition, {"executor": opts.executor},
                         scheduler_ctas=opts.scheduler_ctas, fill_sms=opts.fill_sms)


def compile_fx(gm: GraphModule, opts: CompileOptions, param_flags: list[bool] | None = None,
               input_names: list[str] | None = None) -> Callable:
    """Compile one functionalized ATen graph into a callable taking the graph's flat inputs."""
    compiled = compile_tables(gm, opts, param_flags, input_names)
    if isinstance(compiled, CompiledGraph):
        COMPILED.append(compiled)
        if opts.debug_dir:
            dump(compiled, opts.debug_dir, f"graph{len(COMPILED) - 1}")
        return make_runner(compiled, opts)
    failures = compiled
    if opts.fallback == "error":
        raise UnsupportedOpError(unsupported_report(failures) +
                                 "\nPass options={'fallback': 'eager'} to run these parts in PyTorch.")
    warnings.warn(unsupported_report(failures) + "\nThey run in eager PyTorch (fallback='eager').", stacklevel=2)
    return _compile_with_fallback(gm, {n for n, _ in failures}, opts)


class _Supported(OperatorSupportBase):
    def __init__(self, unsupported):
        self.unsupported = unsupported

    def is_node_supported(self, submodules, node) -> bool:
        return node.op == "call_function" and node not in self.unsupported


class _CompiledSubgraph(torch.nn.Module):
    def __init__(self, runner: Callable, single_output: bool):
        super().__init__()
        self.runner, self.single_output = runner, single_output

    def forward(self, *args):
        out = self.runner(*args)
        return out[0] if self.single_output else tuple(out)


def _compile_with_fallback(gm: GraphModule, unsupported: set, opts: CompileOptions) -> Callable:
    parted = CapabilityBasedPartitioner(gm, _Supported(unsupported), allows_single_node_partition=True)
    fused = parted.partition_and_fuse()
    for node in fused.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(fused, node.target)
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        single = not isinstance(out_node.args[0], (tuple, list))
        if single:
            out_node.args = ((out_node.args[0],),)
            sub.recompile()
        setattr(fused, node.target, _CompiledSubgraph(compile_fx(sub, opts), single))
    fused.recompile()
    return fused


def last_args(runner: Callable) -> list[Any]:
    """The arguments of a GPU runner's last launch, while their owner still holds them."""
    args = [a() if isinstance(a, weakref.ref) else a for a in runner.state["args"]]  # type: ignore[attr-defined]
    if any(a is None for a in args):
        raise MpkError("the last launch's arguments have been freed; run the compiled step again first")
    return args


def make_runner(compiled: CompiledGraph, opts: CompileOptions) -> Callable:
    if opts.executor == "gpu":
        from mpk.executors.gpu import GpuExecutor

        state: dict[str, GpuExecutor] = {}

        def run(*args):
            # Built on first call: the compiler runs under fake tensors, the executor needs real ones.
            if "ex" not in state:
                state["ex"] = GpuExecutor(compiled.tables, timeout_s=opts.timeout_s,
                                          profile=opts.profile_dir is not None)
            # the last launch's arguments (benchmarks re-run them profiled: last_args), weakly: the
            # compiled step outlives a decode loop and must not keep its KV cache alive
            try:
                state["args"] = list(map(weakref.ref, args))
            except TypeError:  # not all tensors
                state["args"] = [weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = state["ex"].run(args, wait=opts.sync)
            if opts.profile_dir:
                Path(opts.profile_dir).mkdir(parents=True, exist_ok=True)
                state["ex"].trace(Path(opts.profile_dir) / f"trace{COMPILED.index(compiled)}.json")
            return out
    else:
        from mpk.executors import Interpreter

        interp = Interpreter(compiled.tables, check_races=opts.check_races)

        def run(*args):
            return interp.run(args, seed=opts.seed)

    run.compiled = compiled  # type: ignore[attr-defined]
    if opts.executor == "gpu":
        run.state = state  # type: ignore[attr-defined]
    RUNNERS[id(compiled)] = run
    return run
