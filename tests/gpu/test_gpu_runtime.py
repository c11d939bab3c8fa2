"""The persistent GPU runtime (marker ``gpu``; skipped without CUDA).

Task families alone (tile-kernel wrapper) and the whole persistent kernel against eager PyTorch
and the CPU interpreter on the op-level test graphs; a random-DAG stress of 10^5 tasks for
100 iterations in one launch with per-task stamps checked on the host; every worker count;
the watchdog's report on a planted never-firing event and on a launch nobody waits on that
hangs inside a task; the profiler's trace; the tables' placement is the one the kernel runs."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
from xml.etree import ElementTree

import numpy as np
import pytest
import torch

from mpk.compiler.place import DEFAULT_SCHEDULER_CTAS
from mpk.compiler.tables import place_tables
from mpk.errors import ExecutorUnavailableError, OptionError
from mpk.executors import Interpreter
from mpk.executors.timeline import breakdown, timeline_svg
from mpk.testing.decode import random_decode_step, random_decoder
from mpk.testing.graphs import compile_with, random_partition, random_program, relative_error, trace_graph
from mpk.testing.random_graphs import force_jit, random_dag, stamp_graph, stamp_inputs
from mpk.testing.tolerance import attention_bound
from mpk.testing.toy_models import LLAMA, QWEN3, Config, GeluMLPBlock, randomize

pytestmark = pytest.mark.gpu
TOL = 1e-5  # fp32, relative to the reference's largest |value|
DEV = "cuda"


def _gpu(tables, **kw):
    from mpk.executors.gpu import GpuExecutor
    return GpuExecutor(tables, **kw)


def _cuda(args):
    return [a.to(DEV) for a in args]


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_match_eager_and_interpreter(seed):
    rng = random.Random(seed)
    fn, args = random_program(rng)
    graph = trace_graph(fn, args)
    tables = compile_with(graph, partition=random_partition(graph, rng), num_workers=8).tables
    expected = fn(*args)
    cpu = Interpreter(tables).run(args, seed=seed)
    ex = _gpu(tables, tile_kernel=True)
    gpu = ex.run(_cuda(args))
    for g, c, e in zip(gpu, cpu, expected):
        assert relative_error(g.cpu(), e) <= TOL
        assert relative_error(g.cpu(), c) <= TOL
    # the same graph op by op through the tile-kernel wrapper (task families without scheduling)
    for op in range(len(tables.ops)):
        ex.run_tile_kernel(op, _cuda(args))
    for g, e in zip(ex.outputs(), expected):
        assert relative_error(g.cpu(), e) <= TOL


@pytest.mark.parametrize("config", [LLAMA, QWEN3, Config(kv_heads=4)], ids=["llama", "qwen3", "mha"])
def test_decoder_through_torch_compile_on_gpu(config):
    model, ids, cos, sin = random_decoder(config, seed=5, batch=3, seq=6)
    with torch.no_grad():
        ref = model(ids, cos, sin)
        out = torch.compile(model.to(DEV), backend="mpk", options={"executor": "gpu"})(
            ids.to(DEV), cos.to(DEV), sin.to(DEV))
    assert relative_error(out.cpu(), ref) <= TOL


def test_gelu_mlp_and_decode_step_on_gpu():
    g = torch.Generator().manual_seed(6)
    model = randomize(GeluMLPBlock(), g).eval()
    x = torch.randn(5, 7, 48, generator=g)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model.to(DEV), backend="mpk", options={"executor": "gpu"})(x.to(DEV))
    assert relative_error(out[0].cpu(), ref[0]) <= TOL and torch.equal(out[2].cpu(), ref[2])
    dec, ids, cos, sin, past = random_decode_step(QWEN3, seed=7)
    with torch.no_grad():
        ref = dec(ids, cos, sin, past)
        out = torch.compile(dec.to(DEV), backend="mpk", options={"executor": "gpu"})(
            ids.to(DEV), cos.to(DEV), sin.to(DEV), _cuda(past))
    assert relative_error(out.cpu(), ref) <= TOL


def _check_stamps(preds, log, runs, iterations):
    log = log.cpu().numpy()
    assert (runs.cpu().numpy() == iterations).all(), "a task did not run exactly once per iteration"
    assert (log >= 0).all(), "a task left no stamp in some iteration"
    start, end = log[..., 0], log[..., 1]
    for t, ps in enumerate(preds):
        if ps:
            assert (start[:, t][:, None] > end[:, list(ps)]).all(), f"task {t} started before a predecessor ended"
    # iterations do not overlap: iteration k+1 starts after every task of iteration k ended
    assert (start[1:].min(axis=1) > end[:-1].max(axis=1)).all()


def test_random_dag_stress_100k_tasks_100_iterations():
    iterations, n = 100, 100_000
    preds = random_dag(n, random.Random(2026))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # no JIT task: no scheduler CTA by default, so every SM can be a worker
    tables = place_tables(stamp_graph(preds, iterations, busy_ns=2000), sms)
    ex = _gpu(tables, timeout_s=120)
    assert ex.scheduler_ctas == 0 and ex.num_workers == sms
    assert ex.layout.worker_queues() == tables.worker_queues()
    clock, runs, log = stamp_inputs(tables, iterations, DEV)
    ex.run([clock, runs, log], iterations=iterations)
    _check_stamps(preds, log, runs, iterations)


@pytest.mark.parametrize("local_jit", [True, False])
def test_random_dag_stress_through_the_schedulers(local_jit):
    """The same check with every task JIT: the schedulers hand each task to a worker when its
    event fires (the plain stress above is all AOT: workers start tasks early and they wait
    inside, on their input gate). With ``local_jit`` an event whose only task is JIT hands it
    to the worker that fired it instead (a share of this DAG's events)."""
    iterations, n = 10, 20_000
    preds = random_dag(n, random.Random(2027))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jit_tables = force_jit(stamp_graph(preds, iterations, busy_ns=500))  # modes changed: placed again
    tables = place_tables(jit_tables, sms - DEFAULT_SCHEDULER_CTAS)
    ex = _gpu(tables, timeout_s=120, local_jit=local_jit)
    from mpk.executors.gpu import EVENT_LOCAL_JIT
    assert ex.scheduler_ctas == DEFAULT_SCHEDULER_CTAS and ex.grid == sms
    with pytest.raises(OptionError, match=r"scheduler_ctas=0, but the graph has \d+ JIT tasks"):
        place_tables(jit_tables, sms, 0)
    assert ((ex.events["flags"] & EVENT_LOCAL_JIT) != 0).any() == local_jit
    clock, runs, log = stamp_inputs(tables, iterations, DEV)
    ex.run([clock, runs, log], iterations=iterations)
    _check_stamps(preds, log, runs, iterations)


def test_every_worker_count_runs_to_completion():
    preds = random_dag(3000, random.Random(3), window=64)
    tables = stamp_graph(preds, 3, busy_ns=200)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sched_ctas in (0, 1, 4):  # an AOT graph runs with scheduler CTAs or without
        for workers in sorted({1, 2, 7, 32, sms // 2, sms - sched_ctas}):
            ex = _gpu(place_tables(tables, workers, sched_ctas), timeout_s=60)
            assert (ex.num_workers, ex.scheduler_ctas) == (workers, sched_ctas)
            clock, runs, log = stamp_inputs(tables, 3, DEV)
            ex.run([clock, runs, log], iterations=3)
            _check_stamps(preds, log, runs, 3)


def test_tables_placing_more_ctas_than_sms_are_refused():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tables = place_tables(stamp_graph(random_dag(50, random.Random(4)), 1), sms, 1)
    with pytest.raises(ExecutorUnavailableError, match=rf"{sms} workers \+ 1 scheduler CTAs = {sms + 1} CTAs .* "
                       rf"has {sms} SMs .* num_workers <= {sms - 1}"):
        _gpu(tables)


def test_watchdog_reports_a_never_firing_event_and_process_stays_usable():
    from mpk.errors import WatchdogTimeout

    preds = [(), (0,), (1,), (1, 2), (3,)]
    tables = stamp_graph(preds, 1)
    waited = int(tables.tasks["dep_event"][3])
    tables.events["num_triggers"][waited] += 5  # never reaches its count
    ex = _gpu(tables, timeout_s=2.0, validate_tables=False)
    with pytest.raises(WatchdogTimeout) as info:
        ex.run(stamp_inputs(tables, 1, DEV))
    msg = str(info.value)
    assert "did not finish within 2.0 s" in msg
    assert f"waits on event {waited}" in msg and "arrivals" in msg
    assert f"event {waited}: counter" in msg and "stay usable" in msg
    # every worker accounted for: stuck, idle, or named by its state
    assert re.search(r"\d+ worker\(s\) idle with no AOT work left; others: (none|\d+ (starting|exited|aborted))", msg)
    # the process and its CUDA context still work
    good = stamp_graph(preds, 2)
    ex2 = _gpu(good)
    clock, runs, log = stamp_inputs(good, 2, DEV)
    ex2.run([clock, runs, log], iterations=2)
    _check_stamps(preds, log, runs, 2)


def test_watchdog_stops_only_the_launch_it_waited_on():
    """Two launches of a graph that never finishes, queued at once (sync=False): the watchdog's
    abort of the first does not pass the second off as finished — it runs, hangs in turn and is
    reported too — and a good launch after them runs to completion."""
    from mpk.errors import WatchdogTimeout

    preds = [(), (0,), (1,), (1, 2), (3,)]
    tables = stamp_graph(preds, 1)
    waited = int(tables.tasks["dep_event"][3])
    tables.events["num_triggers"][waited] += 5  # never reaches its count
    ex = _gpu(tables, timeout_s=1.0, validate_tables=False)
    args = stamp_inputs(tables, 1, DEV)
    first, second = ex.launch(args), ex.launch(args)
    for done in (first, second):
        with pytest.raises(WatchdogTimeout, match="did not finish within 1.0 s") as info:
            ex.wait(done)
        # the second launch, queued while the first ran, left the first's worker states alone
        assert f"waits on event {waited}" in str(info.value)
    good = stamp_graph(preds, 1)
    clock, runs, log = stamp_inputs(good, 1, DEV)
    _gpu(good).run([clock, runs, log])
    _check_stamps(preds, log, runs, 1)


def test_an_unwatched_launch_that_hangs_is_stopped_and_reported_at_the_next_call():
    """sync=False (``run(wait=False)``, a decode loop's call): nothing waits on the launch, yet
    the executor's watchdog thread stops it within timeout_s + 5 s — its tasks busy-spin for up
    to 18 s, and the spin's back-off leaves on the abort flag — and files a report naming the
    task a worker is stuck in; the executor's next call raises it, and a healthy graph runs
    afterwards."""
    import time

    from mpk.errors import WatchdogTimeout

    preds = [()] * 8
    # tile t spins (t · 2654435761) mod (busy_ns + 1) ns (cuda/mpk_tasks/diagnostic.cuh): t · 2.65 s here
    tables = stamp_graph(preds, 1, busy_ns=10 ** 15)
    timeout_s = 2.0
    ex = _gpu(tables, timeout_s=timeout_s)
    args = stamp_inputs(tables, 1, DEV)
    t0 = time.monotonic()
    ex.run(args, wait=False)
    done = ex._last_done
    assert time.monotonic() - t0 < timeout_s, "run(wait=False) returned only after the launch"
    while not done.query():  # the kernel left through the abort path, with nobody waiting on it
        assert time.monotonic() - t0 < timeout_s + 5, "the watchdog did not stop the launch"
        time.sleep(0.01)
    with pytest.raises(WatchdogTimeout) as info:
        ex.launch(args)  # the next call raises the report (before launching anything)
    took = time.monotonic() - t0
    assert timeout_s <= took < timeout_s + 5
    msg = str(info.value)
    assert "did not finish within 2.0 s" in msg and "stay usable" in msg
    longest = int(np.nonzero((tables.tasks["op"] == 0) & (tables.tasks["tile"] == 7))[0][0])  # it spins 18.6 s
    op = tables.meta["ops"][0]
    assert f"inside task {longest} (op {op['name']!r} ({op['kind']}) tile 7), waiting on a busy spin in its body" in msg
    torch.cuda.synchronize()  # nothing else of the launch is left on the stream
    ex.outputs()  # the report was raised once: the executor's calls go on
    good = stamp_graph(preds, 2)
    clock, runs, log = stamp_inputs(good, 2, DEV)
    _gpu(good).run([clock, runs, log], iterations=2)
    _check_stamps(preds, log, runs, 2)


@pytest.mark.parametrize("hop_stamps", [False, True])
def test_profiler_trace_spans_match_executed_tasks(tmp_path, monkeypatch, hop_stamps):
    if hop_stamps:  # the build that also stamps each task's way from the worker's previous one
        monkeypatch.setenv("MPK_NVCC_FLAGS", (os.environ.get("MPK_NVCC_FLAGS", "") + " -DMPK_HOP_STAMPS").strip())
    preds = random_dag(500, random.Random(4))
    tables = stamp_graph(preds, 4, busy_ns=500)  # all AOT: workers start tasks gated
    ex = _gpu(tables, profile=True)
    ex.run(stamp_inputs(tables, 4, DEV), iterations=4)
    path = tmp_path / "trace.json"
    ex.trace(path)
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tables.tasks) * 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(0 <= e["tid"] < sms and e["dur"] >= 0 for e in spans)
    if hop_stamps:  # a worker has a task in hand before it starts, and a gated one reaches its gate before it opens
        ops = [e for e in spans if e["name"] != "dummy"]  # thread 0 completes a dummy task in passing: no hop
        assert ops and all(e["args"]["ready"] <= e["ts"] + 1e-3 for e in ops)
        gated = [e for e in ops if "gate" in e["args"]]
        assert gated and all(e["args"]["ready"] <= e["args"]["gate"] <= e["ts"] + 1e-3 for e in gated)
    else:
        assert not any("ready" in e["args"] or "gate" in e["args"] for e in spans)
    counts = np.bincount([e["args"]["task"] for e in spans], minlength=len(tables.tasks))
    assert (counts == 4).all()
    # each span names its op and kind, and the timeline counts and draws every one
    ops = tables.meta["ops"]
    for e in spans:
        op = int(tables.tasks[e["args"]["task"]]["op"])
        assert (e["cat"], e["args"].get("op")) == ((ops[op]["kind"], ops[op]["name"]) if op >= 0 else ("dummy", None))
    kinds = [ops[int(r["op"])]["kind"] for r in tables.tasks if int(r["op"]) >= 0]
    assert breakdown(path)["tasks"] == {k: 4 * kinds.count(k) for k in set(kinds)}
    svg = ElementTree.fromstring(timeline_svg(path))
    assert len(svg.findall(".//{*}g[@class='kind']/{*}rect")) == len(spans)


def test_outputs_do_not_alias_the_next_launch():
    fn = lambda x, w: torch.relu(x @ w) * 2  # noqa: E731
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randn(4, 8, generator=g) for _ in range(2))
    w = torch.randn(8, 8, generator=g)
    compiled = torch.compile(fn, backend="mpk", options={"executor": "gpu"})
    ya = compiled(a.to(DEV), w.to(DEV))
    yb = compiled(b.to(DEV), w.to(DEV))
    assert relative_error(ya.cpu(), fn(a, w)) <= TOL and relative_error(yb.cpu(), fn(b, w)) <= TOL


def test_rebinding_follows_new_moved_and_strided_arguments():
    """The executor skips re-checking and rebinding arguments that are the tensors of the last
    launch (a decode loop's weights and cache): values changed in place are still read, a new
    tensor or one moved to new storage (set_) is bound again, a strided argument is copied
    afresh at every launch, and a bad shape is still refused after a launch that bound."""
    fn = lambda x, w: torch.relu(x @ w) * 2  # noqa: E731
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    x, w = torch.randn(4, 8, generator=g).to(DEV), torch.randn(8, 8, generator=g).to(DEV)
    tables = compile_with(trace_graph(fn, [x.cpu(), w.cpu()]), num_workers=8).tables
    ex = _gpu(tables)

    def check(*args):
        out = ex.run(list(args))[0]
        assert relative_error(out.cpu(), fn(*(a.cpu() for a in args))) <= TOL

    check(x, w)
    x.copy_(torch.randn(4, 8, generator=g))  # same tensor, new values
    check(x, w)
    check(torch.randn(4, 8, generator=g).to(DEV), w)  # a new tensor
    w.set_(torch.randn(8, 8, generator=g).to(DEV))  # the same object on new storage
    check(x, w)
    wt = torch.randn(8, 8, generator=g).to(DEV).t()  # strided: copied at each launch
    check(x, wt)
    wt.copy_(torch.randn(8, 8, generator=g))
    check(x, wt)
    w.t_()  # the same object, address and shape, transposed in place: copied, not read as before
    check(x, w)
    with pytest.raises(ValueError, match=r"is \(4, 9\)"):
        ex.run([torch.randn(4, 9, device=DEV), w])
    with pytest.raises(ValueError, match=r"argument 1 \(.*\) is int, expected \(8, 8\)"):  # not a tensor
        ex.run([x, 3])


def test_compiled_step_follows_parameters_moved_or_relaid_between_calls():
    """A compiled step's weights changed between calls: new values in place are read; new
    storage (``.data =``) is bound afresh; transposed in place, at the same address and shape,
    the weight is copied to its graph layout rather than read in the old one, whether or not
    dynamo recompiles (torch 2.11 does not guard a parameter's strides: the executor's own check
    of its arguments' keys must see it)."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8, generator=g))

        def forward(self, x):
            return torch.relu(x @ self.w) * 2

    layer = Layer().to(DEV)
    step = torch.compile(layer, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "gpu"})
    x = torch.randn(4, 8, generator=g).to(DEV)

    def check():
        with torch.no_grad():
            out = step(x)
            ref = torch.relu(x.cpu().double() @ layer.w.detach().cpu().double()) * 2
        assert relative_error(out.cpu().double(), ref) <= TOL

    check()
    check()  # the same tensors: the fast path
    with torch.no_grad():
        layer.w.copy_(torch.randn(8, 8, generator=g))  # new values in place
    check()
    layer.w.data = torch.randn(8, 8, generator=g).to(DEV)  # new storage, same Parameter
    check()
    with torch.no_grad():
        layer.w.t_()  # same address and shape, strides swapped
    check()
    x.copy_(torch.randn(4, 8, generator=g))
    check()


def test_strided_copies_and_bad_page_tables_are_clean_under_memcheck(tmp_path):
    """compute-sanitizer's memcheck, with PyTorch's caching allocator off, over the rebinding
    test above (a strided argument's contiguous copy was once freed before the launch that read
    it) and the one-layer bad-page-table test (a kv_indptr past kv_indices must not be followed,
    nor a bad page id, whose k or v lies outside the one-layer cache tensor): no access outside
    an allocation. scripts/gpu_sanitize.sh, narrowed to those two; it first checks that the tool
    reports a planted out-of-bounds write."""
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_sanitize.sh"
    if shutil.which("compute-sanitizer") is None and not glob.glob("/usr/local/cuda*/bin/compute-sanitizer"):
        pytest.skip("compute-sanitizer is not installed")
    if os.environ.get("MPK_UNDER_SANITIZER"):
        pytest.skip("already under compute-sanitizer, which cannot follow a second one")
    env = {**os.environ, "TOOLS": "memcheck", "JOBS": "0", "OUT": str(tmp_path),
           "MEMCHECK_K": "rebinding or (bad_page_table and True-2 and one_layer)"}
    # a session of its own: on a timeout the tool and its pytest go too, not just bash
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("scripts/gpu_sanitize.sh ran past 900 s:\n" + out[-3000:])
    report = out[-3000:] + err[-2000:]
    assert proc.returncode == 0, report
    # the table's row: the planted bug counted, no error in the tests, both passed
    assert re.search(r"^memcheck +\| +[1-9][0-9]* \| +0 \|.*\b2 passed", out, re.M), report


def test_an_executor_dropped_while_its_launch_runs_keeps_what_the_launch_uses():
    """An executor dropped with its asynchronous launch still running hands its module, mapped
    status words and buffers to a list that holds them until that launch's event completes (the
    kernel uses them until then); the next launch of any executor lets go of them."""
    from mpk.executors import gpu

    preds = [()] * 64
    tables = stamp_graph(preds, 1, busy_ns=200_000_000)  # tasks of up to 0.2 s each
    ex = _gpu(tables)
    done = ex.launch(stamp_inputs(tables, 1, DEV))
    ex = None  # noqa: F841 (dropped while the kernel runs)
    held = [h for d, h in gpu._DROPPED if d is done]
    assert len(held) == 1 and any(isinstance(v, gpu.drv.Module) for v in held[0])
    done.synchronize()
    other = _gpu(stamp_graph(preds, 1))
    other.run(stamp_inputs(other.t, 1, DEV))
    assert not any(d is done for d, _ in gpu._DROPPED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_with_every_key_masked_give_zeros(dtype):
    """A boolean mask that hides every key from some query rows (a left-padded prompt's padding
    rows under a causal mask): those rows are zeros, as torch's SDPA gives, and the others match
    it within attention's bound (the output's rounding; D- and Sk-term fp32 sums)."""
    b, h, s, d = 2, 3, 9, 32
    q, k, v = (torch.randn(b, h, s, d, device="cuda").to(dtype) for _ in range(3))
    pad = random.randint(1, s // 2)
    keep = torch.ones(b, s, dtype=torch.bool, device="cuda")
    keep[0, :pad] = False
    mask = (keep[:, None, None, :] & torch.ones(s, s, dtype=torch.bool, device="cuda").tril())

    def attend(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out = torch.compile(attend, backend="mpk", fullgraph=True, dynamic=False,
                        options={"executor": "gpu", "fallback": "error"})(q, k, v, mask)
    ref = attend(q.double(), k.double(), v.double(), mask)
    assert torch.equal(out[0, :, :pad], torch.zeros_like(out[0, :, :pad])) and not out.isnan().any()
    assert relative_error(out, ref) <= attention_bound(dtype, d, s, p_rounded=False)
