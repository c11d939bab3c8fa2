"""Compiler mechanics: determinism, partition overrides, options, errors, fallback, the
interpreter's deadlock and race reports, the tables' round trip."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpk import CompileError, DeadlockError, OptionError, RaceError, UnsupportedOpError
from mpk.compiler.tables import Tables, validate
from mpk.errors import ExecutorUnavailableError, ScheduleError
from mpk.executors import Interpreter
from mpk.inspection import compile_module
from mpk.testing.decode import random_decoder
from mpk.testing.graphs import check_dependencies, compile_with, relative_error, trace_graph
from mpk.testing.toy_models import QWEN3


def _qwen(seed=0, batch=2, seq=3):
    model, ids, cos, sin = random_decoder(QWEN3, seed, batch, seq)
    return model, (ids, cos, sin)


def _chain(x, w):
    h = torch.relu(x @ w)
    return torch.softmax(h + x, dim=-1)


def _chain_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=g), torch.randn(8, 8, generator=g)]


def test_compilation_is_deterministic():
    model, args = _qwen()
    a = compile_module(model, args, {"num_workers": 24}).tables.to_bytes()
    b = compile_module(model, args, {"num_workers": 24}).tables.to_bytes()
    assert a == b
    c = compile_module(model, args, {"num_workers": 25}).tables.to_bytes()
    assert a != c  # the digest does depend on what shapes the tables


def test_tables_round_trip():
    model, args = _qwen()
    tables = compile_module(model, args, {"num_workers": 8}).tables
    again = Tables.from_bytes(tables.to_bytes())
    assert again.to_bytes() == tables.to_bytes() and again.digest() == tables.digest()
    for name in ("tasks", "events", "ops", "buffers", "views", "op_inputs", "bounds", "worker_offsets",
                 "worker_tasks"):
        assert np.array_equal(getattr(again, name), getattr(tables, name))
    # the placement travels with the tables: 8 workers, scheduler CTAs for the attention's JIT tasks
    assert again.meta["placement"] == tables.meta["placement"] == {"num_workers": 8, "scheduler_ctas": 4,
                                                                   "scheduler_warps": 8}
    assert again.worker_queues() == tables.worker_queues() and len(again.worker_queues()) == 8
    with pytest.raises(CompileError, match="not an mpk tables file"):
        Tables.from_bytes(b"garbage" * 4)


def test_task_record_is_small():
    from mpk.compiler.tables import TASK_DTYPE
    assert TASK_DTYPE.itemsize <= 64


def test_partition_overrides_by_name_and_kind():
    args = _chain_args()
    graph = trace_graph(_chain, args)
    mm = next(op.name for op in graph.ops if op.kind == "matmul")
    compiled = compile_with(graph, partition={mm: [3, 2], "softmax": {0: 6}})
    assert compiled.stats.partitions[mm] == (3, 2)
    assert compiled.stats.tasks_per_op[mm] == 6
    sm = next(op.name for op in graph.ops if op.kind == "softmax")
    assert compiled.stats.partitions[sm] == (6, 1)
    out = Interpreter(compiled.tables).run(args)[0]
    assert relative_error(out, _chain(*args)) <= 1e-5


def test_interpreter_names_a_bad_argument():
    """An argument of the wrong shape, dtype or type is refused with its index, name, what it
    is and what the graph expects."""
    args = _chain_args()
    interp = Interpreter(compile_with(trace_graph(_chain, args)).tables)
    x = args[0]
    bad_shape = torch.randn(x.shape[0] + 1, *x.shape[1:])
    for bad, got in [(bad_shape, re.escape(f"{tuple(bad_shape.shape)} {x.dtype}")), (x.double(), re.escape(f"{tuple(x.shape)} torch.float64")),
                     (3, "int")]:
        with pytest.raises(ValueError, match=rf"argument 0 \(.+\) is {got}.*, expected {re.escape(str(tuple(x.shape)))}"):
            interp.run([bad, *args[1:]])


@pytest.mark.parametrize("partition,message", [
    ({"softmax": [2, 2]}, "dim 1 cannot be split"),
    ({"softmax": [2]}, "has 1 entries; its output"),
    ({"softmax": {5: 2}}, "dim 5 out of range"),
    ({"softmax": {0: 7}}, "7 tiles for dim 0 of size 6"),
    ({"softmax": "x"}, r"partition for op 'softmax' \(softmax\) is 'x'; expected a list of one tile count per dim"),
    ({"no_such_op": [1]}, r"name \['no_such_op'\], which match no op"),
])
def test_bad_partition_overrides_are_named(partition, message):
    graph = trace_graph(_chain, _chain_args())
    with pytest.raises(CompileError, match=message):
        compile_with(graph, partition=partition)


def test_partition_by_kind_spans_graph_breaks():
    """A kind override applies to the graphs that have such ops; the graph a break leaves without
    one compiles too (only names must be the graph's own)."""
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            torch._dynamo.graph_break()
            return torch.softmax(h, -1)

    from mpk.backend import COMPILED
    model, x = Broken().eval(), torch.randn(4, 8)
    before = len(COMPILED)
    with torch.no_grad():
        out = torch.compile(model, backend="mpk", options={"executor": "cpu", "partition": {"matmul": [1, 2]}})(x)
        ref = model(x)
    assert relative_error(out, ref) <= 1e-6
    graphs = COMPILED[before:]
    assert len(graphs) == 2 and any(2 in g.stats.tasks_per_op.values() for g in graphs)


def test_rotate_half_with_a_scalar_factor_is_plain_arithmetic():
    """x·2.0 + rotate_half(x)·sin has RoPE's shape but a Python number for cos: not a rope op."""
    f = lambda x, s: x * 2.0 + torch.cat((-x[..., 4:], x[..., :4]), -1) * s  # noqa: E731
    x, s = torch.randn(3, 8), torch.randn(3, 8)
    out = torch.compile(f, backend="mpk", options={"executor": "cpu"})(x, s)
    assert relative_error(out, f(x, s)) <= 1e-6


def test_default_partition_targets_workers():
    graph = trace_graph(lambda x, w: x @ w, [torch.randn(1, 256), torch.randn(256, 4096)])
    compiled = compile_with(graph, num_workers=128)
    # decode-shaped matmul: N split into one wave of 128 tiles, M (= 1) untouched
    assert compiled.stats.partitions[graph.ops[0].name] == (1, 128)


@pytest.mark.parametrize("options,message", [
    ({"executor": "tpu"}, "executor='tpu'; expected one of"),
    ({"fallback": "maybe"}, "fallback='maybe'"),
    ({"num_workers": 0}, "num_workers=0; expected a positive int"),
    ({"num_workers": True}, "num_workers=True; expected a positive int"),
    ({"scheduler_ctas": -1}, r"scheduler_ctas=-1; expected None \(4 when the graph has JIT tasks, else 0\) or an int"),
    ({"scheduler_ctas": 2.0}, "scheduler_ctas=2.0; expected None"),
    ({"fuse_norm_stats": "on"}, "fuse_norm_stats='on'; expected True, False or 'auto'"),
    ({"fuse_norm_stats": 1}, "fuse_norm_stats=1; expected True, False or 'auto'"),
    ({"sync": "auto"}, "sync='auto'; expected True or False"),
    ({"partiton": {}}, r"unknown mpk option\(s\) \['partiton'\]"),
    ({"timeout_s": 0}, "timeout_s=0; expected a finite number of seconds > 0"),
    ({"timeout_s": float("nan")}, "timeout_s=nan; expected a finite number"),
    ({"timeout_s": "30"}, "timeout_s='30'; expected a finite number"),
    ({"check_races": "no"}, "check_races='no'; expected True or False"),
    ({"seed": "x"}, "seed='x'; expected an int"),
    ({"profile_dir": 5}, "profile_dir=5; expected a directory path"),
    ({"debug_dir": __file__}, r"debug_dir='.*test_compiler.py' is a file; expected a directory \(made if absent\)"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(Exception, match=message) as info:
        torch.compile(nn.Linear(4, 4), backend="mpk", options=options)(torch.randn(2, 4))
    assert isinstance(info.value, OptionError) or isinstance(info.value.__cause__, OptionError) \
        or "OptionError" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_executor_without_cuda_is_refused_clearly():
    with pytest.raises(Exception, match="the gpu executor needs a CUDA device; use executor='cpu'") as info, \
            torch.no_grad():
        torch.compile(nn.Linear(4, 4), backend="mpk", options={"executor": "gpu"})(torch.randn(2, 4))
    assert "ExecutorUnavailableError" in str(info.value) or isinstance(info.value, ExecutorUnavailableError)


def test_default_executor_without_cuda_warns_once(monkeypatch):
    import mpk.options as o
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(o, "_warned_cpu_default", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert o.CompileOptions.parse({}).executor == "cpu"
        assert o.CompileOptions.parse({}).executor == "cpu"
    assert sum("CUDA is not available" in str(w.message) for w in rec) == 1


class _LogCumSumExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return torch.logcumsumexp(y, dim=-1) * 2 + y  # aten.logcumsumexp has no mpk lowering


def test_unsupported_op_error_names_op_shapes_and_source():
    with pytest.raises(Exception) as info:
        with torch.no_grad():
            torch.compile(_LogCumSumExp(), backend="mpk", options={"executor": "cpu"})(torch.randn(3, 8))
    msg = str(info.value)
    assert "UnsupportedOpError" in msg or isinstance(info.value, UnsupportedOpError)
    assert "aten::logcumsumexp" in msg
    assert "(3, 8) float32" in msg
    assert re.search(r"test_compiler\.py:\d+: return torch\.logcumsumexp", msg), msg
    assert "fallback" in msg


def test_unsupported_op_in_a_torch_module_names_the_module():
    """torch's own modules record no source line: the report names the layer instead."""
    model = nn.Sequential(nn.Linear(4, 4), nn.RReLU()).eval()
    with pytest.raises(Exception, match=r"aten::rrelu_with_noise_functional .*source module model\.1 \(RReLU; no source line"), \
            torch.no_grad():
        torch.compile(model, backend="mpk", options={"executor": "cpu"})(torch.randn(2, 4))


def test_eager_fallback_runs_the_rest_in_mpk():
    model = _LogCumSumExp().eval()
    x = torch.randn(3, 8)
    from mpk.backend import COMPILED
    before = len(COMPILED)
    with torch.no_grad(), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="mpk", options={"executor": "cpu", "fallback": "eager"})(x)
        ref = model(x)
    assert relative_error(out, ref) <= 1e-5
    assert any("aten::logcumsumexp" in str(w.message) and "eager" in str(w.message) for w in rec)
    assert len(COMPILED) - before == 2  # the parts before and after logcumsumexp are mpk graphs


def test_bit_views_are_not_lowered_as_reshapes():
    """x.view(int32) reinterprets bits: mpk refuses it (naming it), and with fallback='eager'
    the result is PyTorch's, bit for bit."""
    f = lambda x: x.view(torch.int32) + 1  # noqa: E731
    x = torch.randn(7)
    with pytest.raises(Exception, match=r"Tensor.view\(torch.int32\) reinterprets the bits"):
        torch.compile(f, backend="mpk", options={"executor": "cpu"})(x)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(f, backend="mpk", options={"executor": "cpu", "fallback": "eager"})(x)
    assert torch.equal(out, f(x))


def test_reductions_honour_their_dtype_argument():
    """sum / mean with dtype= reduce the converted values (eager PyTorch's result), not the
    input dtype's rounded sum converted afterwards."""
    x = (torch.rand(3, 4096) + 1).bfloat16()
    f = lambda x: (x.sum(-1, dtype=torch.float32), x.mean(-1, dtype=torch.float64))  # noqa: E731
    out = torch.compile(f, backend="mpk", options={"executor": "cpu"})(x)
    for o, ref, tol in zip(out, f(x), (1e-6, 1e-12)):
        assert o.dtype == ref.dtype and relative_error(o, ref) <= tol, (o, ref)


def test_fallback_runs_a_secondary_output_op_in_eager():
    """A graph returning what mpk does not compute (native_layer_norm's mean and rstd) runs that
    op in PyTorch with fallback='eager' (it used to re-partition the same graph until Python's
    recursion limit) and names it with fallback='error'."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    f = lambda x: torch.native_layer_norm(torch.relu(x) * 2, [8], w, b, 1e-5)  # noqa: E731
    x = torch.randn(5, 8)
    with pytest.raises(Exception, match="aten::native_layer_norm .*the mean output of layer_norm"):
        torch.compile(f, backend="mpk", options={"executor": "cpu"})(x)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(f, backend="mpk", options={"executor": "cpu", "fallback": "eager"})(x)
    for o, ref in zip(out, f(x)):
        assert relative_error(o, ref) <= 1e-6


def test_compile_module_dumps_and_refuses_what_it_cannot_honour(tmp_path):
    """compile_module (mpk inspect) writes debug_dir's dump, lists every unsupported op without
    suggesting a fallback it could not run, and refuses fallback='eager' naming it."""
    compiled = compile_module(nn.Linear(8, 8), (torch.randn(2, 8),), {"debug_dir": str(tmp_path)})
    assert (tmp_path / "graph.summary.txt").read_text().strip() and (tmp_path / "graph.tables").exists()
    assert compiled.stats.tasks_per_op
    with pytest.raises(UnsupportedOpError, match=r"aten::logcumsumexp .*\n.*needs the whole graph lowered") as info:
        compile_module(_LogCumSumExp(), (torch.randn(3, 8),))
    assert "fallback" not in str(info.value)
    with pytest.raises(OptionError, match="fallback='eager': compile_module .* expected 'error'"):
        compile_module(_LogCumSumExp(), (torch.randn(3, 8),), {"fallback": "eager"})


def test_compile_module_leaves_the_callers_compiled_models_alone():
    """compile_module traces a copy of the model with a forward of its own: a step the caller
    compiled from the same class (here the same instance) runs on without a recompile (it had
    dropped the class's Dynamo cache, so the step traced and built again), and its tables are
    the ones that step runs."""
    from mpk.backend import COMPILED

    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(2, 8)
    step = torch.compile(model, backend="mpk", options={"executor": "cpu"})
    with torch.no_grad():
        first = step(x)
        built = len(COMPILED)
        inspected = compile_module(model, (x,))
        compile_module(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (x,))
        assert torch.equal(step(x), first) and len(COMPILED) == built
    assert inspected.tables.to_bytes() == COMPILED[-1].tables.to_bytes()


def test_tensor_constant_in_forward_is_lifted_into_an_input():
    f = lambda x: x * torch.tensor([1.0, 2.0, 3.0])  # noqa: E731
    x = torch.randn(2, 3)
    with torch.no_grad():
        out = torch.compile(f, backend="mpk", options={"executor": "cpu"})(x)
    assert torch.equal(out, f(x))  # one float32 multiply: exact


def test_symbolic_shapes_are_refused_clearly():
    with pytest.raises(Exception, match="static shapes only"), torch.no_grad():
        torch.compile(nn.Linear(4, 4), backend="mpk", dynamic=True,
                      options={"executor": "cpu"})(torch.randn(3, 4))


def _compiled_chain():
    args = _chain_args()
    graph = trace_graph(_chain, args)
    return compile_with(graph, partition={"matmul": [2, 2], "pointwise": [2, 2], "softmax": [1, 1]}), args


def test_deadlock_is_reported_with_task_and_event_ids():
    compiled, args = _compiled_chain()
    t = compiled.tables
    # the end event expects one more arrival than there are triggering tasks: never fires
    t.events["num_triggers"][t.end_event] += 1
    with pytest.raises(CompileError, match=rf"event {t.end_event} expects \d+ triggers, \d+ tasks trigger it"):
        validate(t)
    interp = Interpreter(t, validate_tables=False)  # exercise the runtime's own report
    with pytest.raises(DeadlockError, match=r"end event \d+ has \d+ of \d+ arrivals"):
        interp.run(args)


def test_deadlock_on_a_never_firing_event():
    compiled, args = _compiled_chain()
    t = compiled.tables
    # make an inner event wait for one extra trigger: the tasks it launches never start
    inner = next(e for e in range(len(t.events)) if e not in (t.start_event, t.end_event))
    t.events["num_triggers"][inner] += 1
    interp = Interpreter(t, validate_tables=False)
    with pytest.raises(DeadlockError) as info:
        interp.run(args)
    msg = str(info.value)
    assert f"event {inner}:" in msg and "waiting tasks" in msg and "arrivals" in msg


def test_race_is_reported_when_a_dependency_is_missing():
    compiled, args = _compiled_chain()
    t = compiled.tables
    # let the softmax's event fire after one of its producers instead of all of them
    sm_op = next(i for i, o in enumerate(t.meta["ops"]) if o["kind"] == "softmax")
    sm_task = int(np.nonzero(t.tasks["op"] == sm_op)[0][0])
    e = int(t.tasks["dep_event"][sm_task])
    assert t.events["num_triggers"][e] > 1
    t.events["num_triggers"][e] = 1
    with pytest.raises(AssertionError, match="no event path orders them"):
        check_dependencies(t)
    races = surplus = 0
    for seed in range(20):
        interp = Interpreter(t, validate_tables=False)
        try:
            interp.run(args, seed=seed)
        except RaceError as exc:  # the consumer ran before a producer
            races += 1
            assert "read buffer" in str(exc) and "before that task ran" in str(exc)
        except ScheduleError as exc:  # producers all ran first: the surplus arrival is caught
            surplus += 1
            assert "arrivals, expected" in str(exc)
    assert races + surplus == 20 and races > 0


def test_double_write_is_a_race():
    compiled, args = _compiled_chain()
    t = compiled.tables
    mm_op = next(i for i, o in enumerate(t.meta["ops"]) if o["kind"] == "matmul")
    ids = np.nonzero(t.tasks["op"] == mm_op)[0]
    t.tasks["tile"][ids[1]] = t.tasks["tile"][ids[0]]  # two tasks compute the same tile
    with pytest.raises(RaceError, match="both write buffer"):
        Interpreter(t).run(args)


def test_backend_entry_point_needs_no_import(tmp_path):
    """A fresh interpreter that never imports mpk finds the backend through the entry point."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()\n"
            "x = torch.randn(2, 8)\n"
            "assert 'mpk' not in sys.modules\n"
            "with torch.no_grad():\n"
            "    out = torch.compile(m, backend='mpk', options={'executor': 'cpu'})(x)\n"
            "    assert torch.allclose(out, m(x), rtol=1e-5, atol=1e-6)\n"
            "print('ok', 'mpk' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok True"


def test_graph_without_ops_runs():
    """Outputs that are only views of inputs: no op, one dummy task, the end event still fires."""
    x = torch.randn(3, 5)
    out = torch.compile(lambda t: (t.t(), t[1:]), backend="mpk", options={"executor": "cpu"})(x)
    assert torch.equal(out[0], x.t()) and torch.equal(out[1], x[1:])


def test_scalar_first_pointwise_keeps_the_constant_type():
    x = torch.arange(6).reshape(2, 3)
    out = torch.compile(lambda t: 1.5 - t, backend="mpk", options={"executor": "cpu"})(x)
    assert out.dtype == torch.float32 and torch.equal(out, 1.5 - x)


def _cpu(fn):
    return torch.compile(fn, backend="mpk", dynamic=False, options={"executor": "cpu"})


class _Stateful(nn.Module):
    """Returns its state before the step, then updates it (a buffer mutated in forward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("h", torch.randn(4))

    def forward(self, x):
        old = self.h.clone()
        self.h.add_(x)
        return old, x * 2


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_clone_outputs_are_tensors_of_their_own(executor):
    """A clone the caller receives does not share memory with an input or another output (a
    clone had been lowered as its source's buffer: a clone of an input changed when the input
    was mutated after it, and two outputs shared storage); `.contiguous()` is row-major; a view
    of an input stays one, as in eager."""
    dev = "cuda" if executor == "gpu" else "cpu"

    def compiled(fn):
        return torch.compile(fn, backend="mpk", dynamic=False, options={"executor": executor})

    x = torch.randn(3, 4, device=dev)
    before = x.clone()
    y = compiled(lambda x: (x.clone(), x.add_(1))[0])(x)
    assert torch.equal(y, before) and torch.equal(x, before + 1)
    model, ref = _Stateful().to(dev), _Stateful().to(dev)
    ref.h.copy_(model.h)
    step = compiled(model)
    for _ in range(3):
        v = torch.randn(4, device=dev)
        assert torch.equal(step(v)[0], ref(v)[0])
    a, b = compiled(lambda x: (x + 1, (x + 1).clone()))(x)
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    z = compiled(lambda x: (x + 1).transpose(0, 1).contiguous())(x)
    assert z.is_contiguous() and torch.equal(z.view(-1), (x + 1).t().reshape(-1))
    for f in (lambda x: x.clone().split(2)[0], lambda x: x.clone().unbind(0)[1], lambda x: x.to(x.dtype, copy=True)):
        out = compiled(f)(x)  # a piece of a split clone, a same-dtype copying cast: copies too
        out.add_(1)
        assert torch.equal(out, f(x) + 1)
    v = compiled(lambda x: x.t())(x)
    v.mul_(0)
    assert (x == 0).all()  # the view writes through, as eager's does


def test_addmm_with_beta_zero_ignores_the_bias():
    a, b = torch.randn(2, 3), torch.randn(3, 5)
    bias = torch.full((2, 5), float("nan"))
    bias[0, 0] = float("inf")
    out = _cpu(lambda c, a, b: torch.addmm(c, a, b, beta=0))(bias, a, b)
    assert relative_error(out, a.double() @ b.double()) <= 1e-6


def test_cat_of_empty_tensors_is_empty():
    x = torch.randn(5)
    out = _cpu(lambda x: torch.cat([x[:0], x[:0]]) + 1)(x)
    assert out.shape == (0,)


def test_rotate_half_over_an_odd_dim_stays_arithmetic():
    """q·c + rotate(q)·s with an odd last dim is not the rope op (which rotates pairs and would
    refuse it): it compiles as the arithmetic it is."""
    f = lambda q, c, s: q * c + torch.cat((-q[..., 3:], q[..., :3]), -1) * s  # noqa: E731
    q, c, s = (torch.randn(2, 7) for _ in range(3))
    assert relative_error(_cpu(f)(q, c, s), f(q.double(), c.double(), s.double())) <= 1e-6


@pytest.mark.parametrize("make,hint", [
    (lambda: (nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval(), (torch.randn(2, 5, 16),)),
     r"torch.backends.mha.set_fastpath_enabled\(False\)"),
    (lambda: (lambda x: F.dropout(x, 0.5, training=True), (torch.randn(4),)),
     r"dropout with p > 0: mpk compiles inference \(call model.eval\(\)"),
])
def test_ops_without_a_lowering_say_what_to_do(make, hint):
    fn, args = make()
    with pytest.raises(Exception, match=hint), torch.no_grad():
        _cpu(fn)(*args)


def test_transformer_encoder_without_the_fast_path_matches_eager():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            out, ref = _cpu(layer)(x), layer(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    assert relative_error(out, ref) <= 1e-5


# --- placement (compiler step 7a): decided once, in the tables, run by both executors -------------

def _chain_on(workers, **partition):
    args = _chain_args()
    graph = trace_graph(_chain, args)
    return compile_with(graph, partition={"matmul": [2, 2], "pointwise": [2, 2], "softmax": [3, 1], **partition},
                        num_workers=workers).tables, args


def test_placement_round_robins_aot_tasks_in_linear_order():
    from mpk.compiler.tables import FLAG_JIT

    tables, _ = _chain_on(3)
    assert (tables.num_workers, tables.scheduler_ctas, tables.scheduler_warps) == (3, 0, 0)  # no JIT task
    aot = [t for t in range(len(tables.tasks)) if not tables.tasks["flags"][t] & FLAG_JIT]
    assert tables.worker_queues() == [aot[w::3] for w in range(3)]
    assert tables.worker_offsets.tolist() == [0, len(aot[0::3]), len(aot[0::3]) + len(aot[1::3]), len(aot)]


def test_placement_deals_a_run_of_costly_tasks_longest_first():
    """A run of one op's tasks with costs goes to the least loaded worker, longest first (LPT:
    at most 4/3 of the best maximum load, here within the longest task of the mean); tasks
    before and after it keep round-robin's workers; queues stay in linear order."""
    from mpk.compiler.place import placement

    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    W, n = 5, 60
    jit = np.zeros(n, bool)
    costs = np.full(n, np.nan)
    costs[7:47] = rng.uniform(1, 100, 40)
    groups = np.where(np.isnan(costs), np.arange(n) + 1000, 3)
    p = placement(jit, W, costs=costs, groups=groups)
    queues = [p.worker_tasks[p.worker_offsets[w]: p.worker_offsets[w + 1]] for w in range(W)]
    worker = {int(t): w for w, q in enumerate(queues) for t in q}
    assert all((np.diff(q) > 0).all() for q in queues)
    assert all(worker[t] == t % W for t in [*range(7), *range(47, n)])
    load = np.zeros(W)
    for t in range(7, 47):
        load[worker[t]] += costs[t]
    assert load.max() - costs[7:47].sum() / W <= costs[7:47].max()
    # longest first: the long task last in linear order still gets a worker of its own
    p = placement(np.zeros(5, bool), 2, costs=np.array([1.0, 1, 1, 1, 4]), groups=np.zeros(5, int))
    assert sorted(p.worker_tasks[p.worker_offsets[w]: p.worker_offsets[w + 1]].tolist() for w in range(2)) == \
        [[0, 1, 2, 3], [4]]


def test_jit_graph_gets_scheduler_ctas_and_their_option_is_checked():
    model, args = _qwen()
    tables = compile_module(model, args, {"num_workers": 6, "scheduler_ctas": 1}).tables
    assert (tables.num_workers, tables.scheduler_ctas, tables.scheduler_warps) == (6, 1, 4)
    n_jit = int((tables.tasks["flags"] & 1).sum())
    assert n_jit > 0 and len(tables.worker_tasks) == len(tables.tasks) - n_jit
    with pytest.raises(OptionError, match=rf"scheduler_ctas=0, but the graph has {n_jit} JIT tasks, which scheduler "
                       r"warps hand out; expected >= 1"):
        compile_module(model, args, {"num_workers": 6, "scheduler_ctas": 0})


def test_too_many_workers_per_scheduler_is_an_option_error():
    from mpk.compiler.place import placement

    jit = np.array([True, False, False])
    assert placement(jit, 544, 1).scheduler_warps == 4  # 136 workers per scheduler warp: the most
    with pytest.raises(OptionError, match=r"num_workers=545 over scheduler_ctas=1 \(4 scheduler warps\) gives a "
                       r"scheduler more than 136 workers; raise scheduler_ctas to at least 2"):
        placement(jit, 545, 1)
    with pytest.raises(OptionError, match="num_workers=0; expected a positive int"):
        placement(jit, 0)


def test_validate_checks_the_placement():
    from mpk.compiler.tables import place_tables

    tables, _ = _chain_on(2)
    validate(tables)
    bad = place_tables(tables, 2)
    bad.worker_tasks = bad.worker_tasks[:-1].copy()
    bad.worker_offsets = bad.worker_offsets.copy()
    bad.worker_offsets[-1] -= 1
    with pytest.raises(CompileError, match=r"task \d+ is an AOT task and is queued on 0 workers; expected 1"):
        validate(bad)
    jit = place_tables(tables, 2)
    jit.tasks = jit.tasks.copy()
    jit.tasks["flags"][int(jit.worker_tasks[0])] |= 1  # a queued task turned JIT after placement
    with pytest.raises(CompileError, match="no scheduler warp|is a JIT task and is queued"):
        validate(jit)
    with pytest.raises(CompileError, match="is not a CSR"):
        validate(place_tables(tables, 3).__class__(**{**vars(tables), "worker_offsets": np.array([0, 1], np.int32)}))


def test_executors_read_the_same_placement():
    """The interpreter's queues, the GPU executor's device arrays (host side, no CUDA needed)
    and the tables' worker_tasks agree, for tables compiled with and without JIT tasks."""
    from mpk.executors.gpu import SCHED_WARPS_PER_CTA, HostLayout

    model, args = _qwen()
    for tables in (_chain_on(5)[0], compile_module(model, args, {"num_workers": 7}).tables):
        validate(tables)
        layout = HostLayout(tables)
        assert layout.num_workers == Interpreter(tables).num_workers == tables.num_workers
        assert layout.worker_queues() == Interpreter(tables).queues == tables.worker_queues()
        assert layout.aot_offsets.tolist() == tables.worker_offsets.tolist()
        assert layout.num_schedulers == tables.scheduler_ctas * SCHED_WARPS_PER_CTA
        assert layout.active_schedulers == tables.scheduler_warps
        # each AOT entry waits on its task's dependent event
        for w, q in enumerate(layout.worker_queues()):
            for i, task in enumerate(q):
                row = layout.aot_entries[layout.aot_offsets[w] + i]
                assert row[12] == tables.tasks["dep_event"][task]


def test_gpu_executor_refuses_tables_the_device_cannot_hold():
    from mpk.executors.gpu import check_device_fits

    tables, _ = _chain_on(8)
    check_device_fits(tables, 8)  # fits exactly: no scheduler CTA for an AOT graph
    with pytest.raises(ExecutorUnavailableError, match=r"the tables place 8 workers \+ 0 scheduler CTAs = 8 CTAs in "
                       r"one cooperative launch, but the device has 6 SMs .*; compile with options num_workers <= 6"):
        check_device_fits(tables, 6)
    from mpk.compiler.tables import place_tables
    with pytest.raises(ExecutorUnavailableError, match=r"4 workers \+ 2 scheduler CTAs = 6 CTAs .* 5 SMs .* "
                       r"num_workers <= 3 \(or fewer scheduler_ctas than 2\)"):
        check_device_fits(place_tables(tables, 4, 2), 5)


def test_interpreter_runs_each_workers_queue_in_order():
    tables, args = _chain_on(3)
    queues = tables.worker_queues()
    interp = Interpreter(tables)
    orders = set()
    for seed in range(10):
        interp.run(args, seed=seed, iterations=2)
        for k in (1, 2):
            ran = [(t, w) for it, t, w in interp.schedule if it == k]
            assert sorted(t for t, _ in ran) == list(range(len(tables.tasks)))
            for w, q in enumerate(queues):
                assert [t for t, ww in ran if ww == w] == q
            orders.add(tuple(t for t, _ in ran))
    assert len(orders) > 1  # the seed still picks among the ready workers


def test_a_placement_order_deadlock_is_detected():
    """One worker holding a consumer ahead of its producer: the compiler never places so
    (validate refuses it), and the interpreter, which blocks a worker on its queue head as the
    GPU does, reports the deadlock with the blocked worker."""
    tables, args = _chain_on(1)
    queue = tables.worker_tasks.copy()
    assert queue.tolist() == list(range(len(tables.tasks)))
    queue[[0, -1]] = queue[[-1, 0]]  # the last task (a consumer) first
    tables.worker_tasks = queue
    with pytest.raises(CompileError, match=rf"worker 0 queues task {queue[0]} before task {queue[1]}: queues must be "
                       "in increasing linear order"):
        validate(tables)
    with pytest.raises(DeadlockError, match=rf"worker 0 blocked on AOT task {queue[0]} .* waiting for event "
                       r"\d+; released tasks queued behind it: \[1, 2, 3, 0\]"):  # the matmul tiles
        Interpreter(tables, validate_tables=False).run(args)


def test_default_num_workers_fill_the_device():
    """Left to its default, num_workers is the partitioning's target (SMs − 4, or 128 without
    CUDA) and the launch fills the device: the scheduler CTAs' SMs work when there are none."""
    from mpk.compiler.place import placement
    from mpk.options import CompileOptions, default_num_workers

    opts = CompileOptions.parse({"executor": "cpu"})
    assert opts.num_workers is None and opts.partition_workers == default_num_workers()
    assert CompileOptions.parse({"executor": "cpu", "num_workers": 12}).fill_sms is None
    aot, jit = np.zeros(5, bool), np.array([False, True, False])
    assert (placement(aot, 128, fill_sms=132).num_workers, placement(aot, 128, fill_sms=132).scheduler_ctas) == (132, 0)
    assert (placement(jit, 128, fill_sms=132).num_workers, placement(jit, 128, fill_sms=132).scheduler_ctas) == (128, 4)
    assert placement(jit, 128, 2, fill_sms=132).num_workers == 130
    assert placement(aot, 7).num_workers == 7
