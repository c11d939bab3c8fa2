"""The FX-graph pipeline shared by the ``torch.compile`` backend (``mpk.backend``) and
inspection (``mpk.inspection``): a Dynamo graph → the functionalized ATen graph
(``trace_inference``: AOTAutograd, parameters lifted, inference only) → pattern fusion,
lowering and the compiler → a ``CompiledGraph`` of tables (``compile_tables``), or the nodes
that cannot lower (``unsupported_report`` words them).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx import GraphModule

from mpk.compiler import CompiledGraph, compile_graph
from mpk.errors import MpkError
from mpk.frontend import find_unsupported, fuse_patterns, lower
from mpk.frontend.lower import describe_inputs, op_name, source_line
from mpk.frontend.moe import route_moe
from mpk.frontend.patterns import route_attention
from mpk.options import CompileOptions


def pretty_input_name(name: str) -> str:
    """'L_self_modules_layers_modules_0_modules_mlp_parameters_weight_' → 'layers.0.mlp.weight'."""
    name = re.sub(r"^L_(self_)?", "", name).rstrip("_")
    name = re.sub(r"^(modules|parameters|buffers)_", "", name)
    return re.sub(r"_(modules|parameters|buffers)_", ".", name)


def trace_inference(gm: GraphModule, example_inputs: Sequence[Any],
                    fw_compiler: Callable[[GraphModule, list[bool] | None, list[str] | None], Callable]) -> Callable:
    """A Dynamo graph → the functionalized ATen graph mpk compiles: SDPA kept whole, one_hot and
    bincount given static sizes (mpk.frontend.moe.route_moe), AOTAutograd
    (parameters lifted, inference only). ``fw_compiler(aten_gm, param_flags, input_names)``
    compiles it (flags and names are None where AOTAutograd's inputs differ from Dynamo's)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*gm.parameters(), *example_inputs]
                                       if isinstance(t, torch.Tensor)):
        # refused here, not by the backward compiler below: AOTAutograd would first trace a
        # backward through mpk's custom ops (an internal error) or make the forward also return
        # what backward saves (a layer norm's mean and rstd, which mpk does not compute)
        _no_training(gm, example_inputs)
    route_attention(gm)
    route_moe(gm)
    dynamo_inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lifted = [name for name, _ in gm.named_parameters()] + [name for name, _ in gm.named_buffers()]
    names = lifted + [pretty_input_name(str(n.target)) for n in dynamo_inputs]
    flags = [True] * len(lifted) + [isinstance(x, torch.nn.Parameter) for x in example_inputs]

    def fw(fx_gm: GraphModule, fw_inputs):
        n_in = sum(1 for n in fx_gm.graph.nodes if n.op == "placeholder")
        same = n_in == len(names)
        constants = lift_constants(fx_gm)
        fx_flags = flags + [True] * len(constants) if same else None
        fx_names = names + [name for name, _ in constants] if same else None
        return with_constants(fw_compiler(fx_gm, fx_flags, fx_names), [value for _, value in constants])

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=_no_training)


def lift_constants(gm: GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Turn each tensor constant made inside forward (``torch.tensor([...])``, which AOTAutograd
    keeps as a ``get_attr`` of the graph module) into a graph input after the others, as
    lowering reads every tensor from an input. Returns (name, value) per new input, in order;
    the compiled callable must receive the values after the graph's own inputs
    (``with_constants``). A fill or count made in forward (``torch.ones``, ``arange``) is no
    constant here: lowering computes it in the kernel."""
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lifted: list[tuple[str, torch.Tensor]] = []
    for node in nodes:
        value = getattr(gm, str(node.target))
        if not isinstance(value, torch.Tensor) or not node.users:
            continue  # a submodule or an unused attribute: lowering reports what it must
        anchor = placeholders[-1] if placeholders else next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(anchor) if placeholders else gm.graph.inserting_before(anchor):
            ph = gm.graph.placeholder(f"const_{node.name}")
        ph.meta.update(node.meta)  # its fake value, stack trace
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        placeholders.append(ph)
        lifted.append((str(node.target), value))
    if lifted:
        gm.recompile()
    return lifted


def with_constants(fn: Callable, constants: list[torch.Tensor]) -> Callable:
    """``fn`` called with ``constants`` after the caller's arguments, on the first tensor
    argument's device (a CUDA graph's constants live beside its inputs), moved once per device."""
    if not constants:
        return fn
    by_device: dict[torch.device, list[torch.Tensor]] = {}

    def run(*args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), constants[0].device)
        if device not in by_device:
            by_device[device] = [c.to(device) for c in constants]
        return fn(*args, *by_device[device])

    for attr in ("compiled", "state"):  # what mpk.backend's runners carry (last_args, RUNNERS)
        if hasattr(fn, attr):
            setattr(run, attr, getattr(fn, attr))
    return run


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
                   input_names: list[str] | None = None, check: bool | None = None) -> CompiledGraph | list:
    """Pattern fusion, lowering and the compiler on one functionalized ATen graph: its
    CompiledGraph, or the nodes that cannot lower as (node, reason) pairs. ``check``: run the
    happens-before check (default: for the cpu executor, or with the ``verify`` option)."""
    fuse_patterns(gm, opts.optional_fusions(), opts.partition_workers)
    failures = find_unsupported(gm, opts.fuse_rope_attention)
    if failures:
        return failures
    graph = lower(gm, param_flags, input_names, opts.fuse_rope_attention, opts.partition_workers)
    sharded = None
    if opts.tensor_parallel is not None:
        from mpk.distributed.shard import shard_graph

        sharded = shard_graph(graph, *opts.tensor_parallel, opts.comm_tiles)
        graph = sharded.graph
    # the happens-before check runs on every compile for the CPU interpreter (whose random
    # schedules alone can miss a missing order) and on request for the GPU kernel
    meta_options = {"executor": opts.executor}
    if opts.tensor_parallel is not None:  # (Tables.rank_free_digest reads the rank from here)
        meta_options["tensor_parallel"] = list(opts.tensor_parallel)
    compiled = compile_graph(graph, opts.partition_workers, opts.partition, meta_options,
                             scheduler_ctas=opts.scheduler_ctas, fill_sms=opts.fill_sms, split_k=opts.split_k,
                             pipelining=opts.pipelining,
                             check=(opts.executor == "cpu" or opts.verify) if check is None else check)
    compiled.sharded = sharded
    return compiled
