"""The ``torch.compile`` backend: Dynamo graph → AOTAutograd (functionalized ATen, parameters
lifted, inference) → pattern fusion → OpGraph → tables → an executor.

Registered as the ``mpk`` entry point of ``torch_dynamo_backends``, so
``torch.compile(model, backend="mpk")`` works without importing mpk.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from mpk.compiler import CompiledGraph
from mpk.errors import MpkError, NotSupportedError, OptionError, UnsupportedOpError
from mpk.fx_pipeline import compile_tables, trace_inference, unsupported_report
from mpk.inspection import dump
from mpk.options import CompileOptions

# Every CompiledGraph built in this process, newest last (inspection and tests read it), and
# the runner made for each (by id of the CompiledGraph) while something else (the compiled
# model) keeps it alive: a runner holds its executor's GPU buffers and last arguments.
COMPILED: list[CompiledGraph] = []
RUNNERS: weakref.WeakValueDictionary[int, Callable] = weakref.WeakValueDictionary()


class TracedOnly(Exception):
    """Raised by a call of an mpk-compiled graph inside ``trace_only()``: the graph is compiled
    (``compiled``), nothing ran."""

    def __init__(self, compiled: CompiledGraph):
        super().__init__("an mpk graph was called inside trace_only(); it was compiled, not run")
        self.compiled = compiled


_TRACE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("mpk_trace_only", default=False)


@contextlib.contextmanager
def trace_only() -> Iterator[None]:
    """Within it, calling a compiled model compiles its graph (when Dynamo has none for these
    inputs) and raises ``TracedOnly`` at its first mpk graph instead of running it: no executor
    is built, no input is written (with ``fallback="eager"``, the eager parts before that graph
    do run). A set of graphs can be traced first and their kernels built together
    (``mpk.llm.buckets``); Dynamo keeps each graph, so a later call outside runs it."""
    token = _TRACE_ONLY.set(True)
    try:
        yield
    finally:
        _TRACE_ONLY.reset(token)


_ITERATIONS: contextvars.ContextVar[int] = contextvars.ContextVar("mpk_iterations", default=1)


@contextlib.contextmanager
def iterations(k: int) -> Iterator[None]:
    """Within it, each call of an mpk-compiled graph is ONE launch running ``k`` iterations of
    the graph back to back (the runtime's event counters; the end event of iteration i starts
    iteration i + 1), for graphs that feed their own inputs (``mpk.ops.iteration``): a
    multi-step decode (``mpk.llm.multistep``). The outputs are the last iteration's. Meant for
    graphs compiled whole: with ``fallback="eager"`` the PyTorch parts would run once."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < 2 ** 31:
        raise OptionError(f"iterations({k!r}); expected an int in [1, 2^31)")
    token = _ITERATIONS.set(k)
    try:
        yield
    finally:
        _ITERATIONS.reset(token)


def mpk_backend(gm: GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None):
    """Dynamo backend entry point (``torch.compile(model, backend="mpk", options={...})``)."""
    opts = CompileOptions.parse(options)
    return trace_inference(gm, example_inputs, lambda fx_gm, flags, names: compile_fx(fx_gm, opts, flags, names))


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


def _remember(state: dict, args: tuple) -> None:
    """The last launch's arguments (benchmarks re-run them profiled, TokenBuckets replays them:
    last_args), weakly: the compiled step outlives a decode loop and must not keep its KV
    cache alive."""
    try:
        state["args"] = list(map(weakref.ref, args))
    except TypeError:  # not all tensors
        state["args"] = [weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args]


def _sharded(run: Callable, compiled: CompiledGraph, opts: CompileOptions) -> Callable:
    """The runner of a tensor-parallel rank's graph: the caller passes the full model's
    arguments (mpk.distributed.binding: shards made once and cached, communication buffers from
    the process's SymmetricAllocator)."""
    from mpk.distributed.binding import sharded_runner
    from mpk.distributed.symmetric import allocator_for

    rank, world = opts.tensor_parallel
    if opts.executor == "cpu" and world > 1:
        raise NotSupportedError(f"tensor_parallel=({rank}, {world}) with the cpu executor: one interpreter runs one "
                                "rank; run the ranks together with mpk.distributed.ranks.run_ranks")
    device = torch.device("cuda" if opts.executor == "gpu" else "cpu")
    state: dict[str, Callable] = {}

    def run_rank(*full):
        if _TRACE_ONLY.get():
            raise TracedOnly(compiled)
        if "run" not in state:  # the allocator is asked at the first call (the compiler ran under fake tensors)
            state["run"] = sharded_runner(run, compiled.sharded, allocator_for(rank, world, device))
        return state["run"](*full)

    return run_rank


def make_runner(compiled: CompiledGraph, opts: CompileOptions) -> Callable:
    state: dict[str, Any] = {}
    if opts.executor == "gpu":
        from mpk.executors.gpu import GpuExecutor

        def run(*args):
            if _TRACE_ONLY.get():
                raise TracedOnly(compiled)
            # Built on first call: the compiler runs under fake tensors, the executor needs real ones.
            if "ex" not in state:
                state["ex"] = GpuExecutor(compiled.tables, timeout_s=opts.timeout_s,
                                          profile=opts.profile_dir is not None)
            _remember(state, args)
            out = state["ex"].run(args, iterations=_ITERATIONS.get(), wait=opts.sync)
            if opts.profile_dir:
                Path(opts.profile_dir).mkdir(parents=True, exist_ok=True)
                state["ex"].trace(Path(opts.profile_dir) / f"trace{COMPILED.index(compiled)}.json")
            return out
    else:
        from mpk.executors import Interpreter

        interp = Interpreter(compiled.tables, check_races=opts.check_races)

        def run(*args):
            if _TRACE_ONLY.get():
                raise TracedOnly(compiled)
            _remember(state, args)
            return interp.run(args, seed=opts.seed, iterations=_ITERATIONS.get())

    if compiled.sharded is not None:
        run = _sharded(run, compiled, opts)
    run.compiled = compiled  # type: ignore[attr-defined]
    run.state = state  # type: ignore[attr-defined]
    RUNNERS[id(compiled)] = run
    return run
