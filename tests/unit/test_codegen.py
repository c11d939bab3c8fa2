"""Generated CUDA: compiles with nvcc for sm_90a (on CI, which has nvcc but no GPU), the build
cache skips nvcc the second time, and build errors name the file and nvcc's message."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from mpk.errors import CompileError
from mpk.executors import build
from mpk.executors.codegen import fast_divisor, generate
from mpk.inspection import compile_module
from mpk.ops.linalg import op_form
from mpk.testing.conv_models import UNetBlock, randomize_batch_norms
from mpk.testing.graphs import compile_with, random_partition, trace_graph
from mpk.testing.op_zoo import CASES, Zoo, zoo_inputs
from mpk.testing.random_graphs import random_dag, stamp_graph
from mpk.testing.toy_models import QWEN3, Decoder, GeluMLPBlock, randomize, rope_tables

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")


def _toy_decoder():
    g = torch.Generator().manual_seed(0)
    model = randomize(Decoder(QWEN3), g).eval()
    ids = torch.randint(0, QWEN3.vocab, (2, 4), generator=g)
    cos, sin = rope_tables(QWEN3, torch.arange(4))
    return model, ids, cos, sin


def _qwen3_toy():
    model, ids, cos, sin = _toy_decoder()
    return compile_module(model, (ids, cos, sin), {"num_workers": 16}).tables


def _qwen3_toy_decode():
    model, ids, cos, sin = _toy_decoder()
    past = [torch.randn(1, QWEN3.kv_heads, 5, QWEN3.head_dim) for _ in range(2 * QWEN3.layers)]
    return compile_module(model, (ids[:1, :1], cos[:1], sin[:1], past), {"num_workers": 16}).tables


def _chain():
    args = [torch.randn(4, 8), torch.randn(8, 8)]
    graph = trace_graph(lambda x, w: torch.softmax(torch.relu(x @ w) + x, -1), args)
    return compile_with(graph, random_partition(graph, random.Random(0))).tables


def _elementwise(dtype: torch.dtype):
    return lambda: compile_module(Zoo(list(CASES)), zoo_inputs(dtype), {"num_workers": 16}).tables


# name → a function making its tables: each test compiles its own graph, not every collection
GRAPHS = {
    "qwen3-toy": _qwen3_toy,
    "qwen3-toy-decode": _qwen3_toy_decode,
    "gelu-mlp": lambda: compile_module(randomize(GeluMLPBlock(), torch.Generator().manual_seed(0)),
                                       (torch.randn(3, 48),), {"num_workers": 8}).tables,
    # conv, pool, batch norm, upsampling (gathers)
    "unet": lambda: compile_module(randomize_batch_norms(UNetBlock(), torch.Generator().manual_seed(0)),
                                   (torch.randn(1, 3, 8, 8),), {"num_workers": 8}).tables,
    "chain": _chain,
    "stamp-dag": lambda: stamp_graph(random_dag(300, random.Random(0)), iterations=3, busy_ns=100),
    "qwen3-1.7b-paged": lambda: _paged_decode_tables(),
    "qwen3-1.7b-paged-split": lambda: _paged_decode_tables(cache_len=1000),  # KV chunks merged by attn_merge
    "qwen3-1.7b-paged-unfused": lambda: _paged_decode_tables(fuse_rope_attention=False),
    "qwen3-bf16-fused-norm": lambda: _compiled_decode_tables("qwen3", fuse_norm_prologue=True),
    "qwen3-bf16-split-k": lambda: _compiled_decode_tables("qwen3", split_k=2),  # matmul_partial + matmul_finish
    "sampling-head": lambda: _sampling_head_tables(),
    "ragged-prefill-bf16": lambda: _ragged_tables(torch.bfloat16, [0, 40, 7], [150, 33, 1], splits=2),
    "ragged-prefill-fp16-d64": lambda: _ragged_tables(torch.float16, [0, 0], [40, 9], head_dim=64, qk_norm=False),
    "ragged-mixed-fp32": lambda: _ragged_tables(torch.float32, [0, 40, 7], [5, 1, 1], splits=2),
    # every elementwise function, reduction, softmax form
    **{f"elementwise-{str(dtype)[6:]}": _elementwise(dtype)
       for dtype in (torch.float32, torch.bfloat16, torch.float64)},
}


class _SamplingHead(torch.nn.Module):
    """Reductions and softmaxes over rows long and short, contiguous and not, bf16 and fp32."""

    def forward(self, logits, short, f32):
        return (torch.argmax(logits, -1), torch.softmax(logits, -1), logits.float().sum(-1),
                torch.amax(logits, -1, keepdim=True), torch.argmax(short, -1), torch.softmax(short, -1),
                torch.softmax(f32, -1), f32.mean(-1), torch.argmax(logits[:, 1:], -1))


def _sampling_head_tables():
    args = (torch.randn(3, 8192).bfloat16(), torch.randn(20, 1000).bfloat16(), torch.randn(2, 4096))
    return compile_module(_SamplingHead(), args, {"num_workers": 16}).tables


def _paged_decode_tables(cache_len: int = 100, **options):
    """One layer of the qwen3-1.7b-shaped decode step over a paged cache (meta tensors); up to
    255 positions attend in one chunk (no merge op), 1000 in 3."""
    import argparse

    from mpk.cli import PRESETS

    ns = argparse.Namespace(layers=1, batch=2, cache_len=cache_len, seq=1)
    model, args = PRESETS["qwen3-1.7b-paged"](ns)
    return compile_module(model, args, {"num_workers": 128, **options}).tables


def _ragged_tables(dtype: torch.dtype, prefix: list[int], new: list[int], splits: int = 1, head_dim: int = 128,
                   qk_norm: bool = True):
    """A ragged step (mpk.testing.ragged: rope_append then paged_attention with qo_indptr) of
    sequences with ``prefix`` cached and ``new`` new rows, 16 query heads over 4 kv heads, traced
    and compiled for 128 workers (nothing run); its tables."""
    from mpk.testing.ragged import ragged_batch, ragged_step, random_case

    g = torch.Generator().manual_seed(0)
    case = random_case(ragged_batch(prefix, new, 16, g, padding=3), 16, 4, head_dim, qk_norm, g, dtype)

    class Step(torch.nn.Module):
        def forward(self, qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, q_norm, k_norm, qo_indptr):
            return ragged_step(case, splits)(qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, q_norm,
                                             k_norm, qo_indptr)

    return compile_module(Step(), case.args(), {"num_workers": 128}).tables


def test_ragged_tasks_are_instantiated_per_graph():
    """The ragged form's tasks: rope_append_impl's kRagged instantiation; attention on the
    tensor cores a block of rows at a time (attn_prefill) for 16-bit K/V of head dim 64 or 128
    in tiles of several rows, each row on its own (attn_partial's kRagged) for fp32 or a step of
    at most DECODE_ROWS rows (one row a tile); the launch reserves attn_prefill's second K/V step
    (dynamic shared memory); a rope_append with qk-norm and qo_indptr has 9 inputs, so that
    graph's op constants hold 9 views (MPK_MAX_INPUTS), while other graphs keep 8."""
    from mpk.executors.codegen import dynamic_smem_bytes
    from mpk.ops.paged import PREFILL_STAGE_BYTES

    prefill = _ragged_tables(torch.bfloat16, [0, 40, 7], [150, 33, 1], splits=2)
    src = generate(prefill)
    # chunks: the balanced split (its plan, the planned tiles and merge)
    for inst in ("mpk::rope_append_impl<4, __nv_bfloat16, int, true>", "mpk::attn_plan<int>",
                 "mpk::attn_prefill<4, 4, __nv_bfloat16, int, false, true>", "mpk::attn_merge_planned<4, __nv_bfloat16>"):
        assert src.count(inst) == 1, inst
    assert "#define MPK_MAX_INPUTS 9" in src and dynamic_smem_bytes(prefill) == PREFILL_STAGE_BYTES
    one = generate(_ragged_tables(torch.bfloat16, [0, 40, 7], [150, 33, 1], splits=1))
    assert "mpk::attn_prefill<4, 4, __nv_bfloat16, int, true>" in one and "attn_plan" not in one
    mixed = generate(_ragged_tables(torch.bfloat16, [0, 40, 7], [5, 1, 1], qk_norm=False))
    assert "mpk::attn_partial<4, 4, __nv_bfloat16, int, false, true, true>" in mixed and "attn_prefill<" not in mixed
    # a decode-sized step, chunks left to the compiler: at least two slots a row, for the plan to
    # spread a long sequence over
    assert "mpk::attn_partial<4, 4, __nv_bfloat16, int, false, false, true, true>" in generate(
        _ragged_tables(torch.bfloat16, [0, 400, 7], [5, 1, 1], splits=0, qk_norm=False))
    assert "MPK_MAX_INPUTS" not in mixed  # 8 inputs without qk-norm
    assert "mpk::attn_partial<4, 4, float, int, false, false, true, true>" in generate(
        _ragged_tables(torch.float32, [0, 40, 7], [150, 1, 1], splits=2))
    assert "MPK_MAX_INPUTS" not in generate(_paged_decode_tables())


def test_prefill_stage_bytes_agree_with_the_header():
    """attn_prefill's K/V step (paged_prefill.cuh: kPrefillStageBytes) is the dynamic shared
    memory the host reserves for it (mpk.ops.paged.PREFILL_STAGE_BYTES)."""
    from mpk.ops.paged import PREFILL_STAGE_BYTES

    from pathlib import Path

    header = (Path(__file__).resolve().parents[2] / "cuda" / "mpk_tasks" / "paged_prefill.cuh").read_text()
    assert re.findall(r"constexpr int kPrefillStageBytes = (\d+);", header) == [str(PREFILL_STAGE_BYTES)]


def test_long_attention_chunks_reserve_a_second_slot():
    """Paged attention's second K/V slot per warp is reserved (dynamic shared memory) only where
    a warp's share of a chunk runs to many steps: not for a short cache (its launch reserves less
    than the slots' bytes), and for a long one with its chunks of 512+ positions."""
    from mpk.executors.codegen import (
        ATTN_SECOND_SLOT_BYTES,
        ATTN_SECOND_SLOT_MIN_STEPS,
        attention_steps,
        dynamic_smem_bytes,
    )

    def steps(tables):
        return max(attention_steps(tables, i) for i in range(len(tables.ops))
                   if tables.meta["ops"][i]["kind"] in ("attn_partial", "rope_attn_partial"))

    short, long = _paged_decode_tables(), _paged_decode_tables(cache_len=16384)
    assert steps(short) < ATTN_SECOND_SLOT_MIN_STEPS <= steps(long)
    assert dynamic_smem_bytes(short) < ATTN_SECOND_SLOT_BYTES == dynamic_smem_bytes(long)


def test_a_short_sequence_in_few_chunks_counts_its_longest_chunk():
    """A sequence that uses fewer chunks than its op has (mpk.ops.paged.chunk_bounds) walks one
    chunk of up to 2 · MIN_CHUNK − 1 positions: attention_steps counts that chunk, not the
    capacity over the chunks, so a cache of short rows (fp32, d = 128: 4 positions a step)
    reserves the second K/V slots (the capacity's 4 chunks of ~80 positions would count 3 steps)."""
    from mpk.backend import COMPILED
    from mpk.executors.codegen import (
        ATTN_SECOND_SLOT_BYTES,
        ATTN_SECOND_SLOT_MIN_STEPS,
        attention_steps,
        dynamic_smem_bytes,
    )
    from mpk.frontend.fused_ops import paged_attention
    from mpk.testing.decode import random_page_table

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    _, indptr, indices, last, num_pages = random_page_table([300], 16, g, spare=0)
    cache = torch.randn(1, 2, num_pages, 4, 16, 128, generator=g)
    q = torch.randn(1, 8, 128, generator=g)

    def attend(q, cache, indptr, indices, last):
        return paged_attention(q, cache, indptr, indices, last, 0, 0.1, 4)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(attend, backend="mpk", dynamic=False, options={"executor": "cpu"})(q, cache, indptr, indices, last)
    tables = COMPILED[-1].tables
    attn = next(i for i in range(len(tables.ops)) if tables.meta["ops"][i]["kind"] == "attn_partial")
    assert attention_steps(tables, attn) == -(-255 // 32) >= ATTN_SECOND_SLOT_MIN_STEPS
    assert dynamic_smem_bytes(tables) == ATTN_SECOND_SLOT_BYTES


def _compiled_decode_tables(family: str, dtype: torch.dtype = torch.bfloat16, batch: int = 2, hidden: int = 128,
                            inter: int = 256, heads: int = 4, **options):
    """A small DecoderLM decode step through torch.compile (Dynamo, as users compile it:
    every pattern fusion applies), run once on the CPU interpreter; its tables."""
    from mpk.backend import COMPILED
    from mpk.llm import DecoderLM, LLMConfig, PagedKVCache

    cfg = LLMConfig(family=family, hidden=hidden, inter=inter, layers=1, heads=heads, kv_heads=2, head_dim=64,
                    vocab=64, tied=True, eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position=64)
    model = DecoderLM(cfg, dtype).randomize(seed=0)
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu", **options})
    kv = PagedKVCache(model, batch, 16, 4)
    kv.grow([1 + b % 3 for b in range(batch)])
    with torch.no_grad():
        step(torch.arange(batch) % cfg.vocab, *kv.args())
    return COMPILED[-1].tables


def test_paged_decode_tasks_are_instantiated_per_graph():
    """Each paged task template is instantiated once for the graph's (head dim, group, dtype),
    rope_append runs inside the attention tasks (rope_attn_partial) unless that fusion is off,
    and SiLU·mul is the gate·up projection's epilogue, not an op of its own."""
    tables = _paged_decode_tables()
    src = generate(tables)
    assert src.count("mpk::attn_partial<4, 2, __nv_bfloat16, int, true, true>") == 1  # one chunk: no merge
    assert "rope_append_impl<" not in src and "attn_merge_impl<" not in src
    split = generate(_paged_decode_tables(cache_len=1000))
    for inst in ("mpk::attn_partial<4, 2, __nv_bfloat16, int, true, false>",
                 "mpk::attn_merge_impl<4, __nv_bfloat16>"):
        assert split.count(inst) == 1, inst
    unfused = generate(_paged_decode_tables(fuse_rope_attention=False))
    for inst in ("mpk::rope_append_impl<4, __nv_bfloat16, int>",
                 "mpk::attn_partial<4, 2, __nv_bfloat16, int, false, true>"):
        assert unfused.count(inst) == 1, inst
    kinds = [op_form(m["kind"], m["attrs"]) for m in tables.meta["ops"]]
    assert "silu_mul" not in kinds and kinds.count("norm_stats_matmul_silu_mul") == kinds.count("norm_stats_matmul") == 1  # gate·up and the LM head, after split norms


class _SiluMul(torch.nn.Module):
    def forward(self, gate, up):
        return torch.nn.functional.silu(gate) * up


# (3, 1000, 3): tile bounds off 8-element words; float16: not the bf16 kernel
@pytest.mark.parametrize("rows,n,tiles,dtype,variant", [(1, 8192, 8, torch.bfloat16, 1), (16, 12288, 128, torch.bfloat16, 1),
                                                       (3, 1000, 3, torch.bfloat16, 0), (2, 512, 2, torch.float16, 0)])
def test_standalone_silu_mul_variant(rows, n, tiles, dtype, variant):
    """A SiLU·mul left as an op of its own takes the vectorised bf16 task where its views and
    tile bounds fall on 16-byte words."""
    from mpk.executors.codegen import silu_mul_variant

    gate, up = (torch.randn(rows, n, dtype=dtype) for _ in range(2))
    tables = compile_module(_SiluMul(), (gate, up), {"partition": {"silu_mul": [1, tiles]}}).tables
    assert [m["kind"] for m in tables.meta["ops"]] == ["silu_mul"]
    assert silu_mul_variant(tables, 0) == variant


GATE_UP_DOWN, ALL_FOUR = ["2048×512", "512×1024"], ["2048×512", "512×1024", "512×512", "768×512"]


@pytest.mark.parametrize("dtype, batch, reason, named", [
    (torch.float16, 2, "its operands are float16, not bfloat16", GATE_UP_DOWN),
    (torch.float32, 1, "its operands are float32, not bfloat16", ALL_FOUR),
    (torch.float32, 24, "its operands and output are float32, not all bfloat16 or all float16", ALL_FOUR),
])
def test_projections_off_the_decode_linear_are_named_in_a_warning(dtype, batch, reason, named):
    """A decode step neither the bandwidth-grade linear (≤ 16 rows) nor the tensor-core GEMM
    (more rows) can take (its dtype) still compiles, but the build warns, naming why and each
    projection of ≥ 1 MiB of weights (in 16-bit types gate·up, 2048×512, and down, 512×1024,
    not the 768×512 qkv or the 512×512 o; in float32 all four); a bf16 step builds without the
    warning at batch 16 (the decode linear) and 24 (the GEMM)."""
    from mpk.errors import PerformanceWarning

    shape = dict(hidden=512, inter=1024, heads=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        for rows in (16, 24):
            generate(_compiled_decode_tables("qwen3", torch.bfloat16, rows, **shape))
    tables = _compiled_decode_tables("qwen3", dtype, batch, **shape)
    with pytest.warns(PerformanceWarning) as caught:
        generate(tables)
    message = str(caught[0].message)
    lines = re.findall(r"^  '[^']+' \((\w+), weight (\d+×\d+)\): (.*)$", message, re.M)
    assert sorted(w for _, w, _ in lines) == named, message
    assert all(why == reason for _, _, why in lines), message
    assert message.startswith(f"mpk: {len(named)} projection(s) run the general CUDA matmul task")


def test_long_rows_take_the_cta_per_row_tasks():
    """Reductions and softmaxes over rows of ≥ LONG_ROW elements in whole 16-byte words take
    the typed CTA-per-row tasks (the reduction a template argument) and a task per row; short
    rows and rows off 16-byte words keep the general tasks and tiles of several rows."""
    from mpk.executors.codegen import aligned_inputs, row_vector_ctype

    tables = _sampling_head_tables()
    got = {}
    for i, o in enumerate(tables.ops):
        meta = tables.meta["ops"][i]
        if meta["kind"] in ("reduce", "softmax"):
            got[meta["name"]] = (row_vector_ctype(tables, i), int(o["grid"][0]))
    assert got == {"argmax": ("__nv_bfloat16", 3), "softmax": ("__nv_bfloat16", 3), "sum_1": ("float", 3),
                   "amax": ("__nv_bfloat16", 3), "argmax_1": (None, 2), "softmax_1": (None, 16),
                   "softmax_2": ("float", 2), "mean": ("float", 2), "argmax_2": (None, 3)}, got
    src = generate(tables)
    for inst in ("reduce_rows<__nv_bfloat16, 3>", "reduce_rows<float, 0>", "reduce_rows<__nv_bfloat16, 2>",
                 "reduce_rows<float, 1>", "softmax_rows<__nv_bfloat16, __nv_bfloat16>", "softmax_rows<float, float>",
                 "task_reduce(", "task_softmax("):
        assert src.count(f"mpk::{inst}") == 1, inst
    assert {tables.meta["buffers"][b]["name"] for b in aligned_inputs(tables)} == {"logits", "f32"}


def _paged_attention_tables(index_dtypes):
    """A paged attention (one layer, sequences of 3 and 9 positions over pages of 4) compiled
    for the CPU interpreter, its page table (kv_indptr, kv_indices, kv_last_page_len) in
    ``index_dtypes``; its tables."""
    from mpk.backend import COMPILED

    page_size = 4
    indptr, indices, last = ([0, 1, 4], [2, 0, 1, 3], [3, 1])
    q, cache = torch.randn(2, 4, 64), torch.randn(1, 2, 5, 2, page_size, 64)
    table = [torch.tensor(v, dtype=d) for v, d in zip((indptr, indices, last), index_dtypes)]

    def attend(q, cache, indptr, indices, last):
        return torch.ops.mpk.paged_attention(q, cache, indptr, indices, last, 0, 0.125, 1)

    torch.compile(attend, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})(q, cache, *table)
    return COMPILED[-1].tables


def test_page_table_index_type_is_a_template_argument():
    """The paged tasks read the page table as its own integer type (no per-element dtype
    switch): int32 and int64 tables instantiate ``int`` and ``long long``; tables of mixed or
    other dtypes are refused with the dtypes named."""
    assert "float, int, false, true>" in generate(_paged_attention_tables([torch.int32] * 3))
    assert "float, long long, false, true>" in generate(_paged_attention_tables([torch.int64] * 3))
    with pytest.raises(CompileError, match=r"share one dtype, int32 or int64; got \['int32', 'int64'\]"):
        generate(_paged_attention_tables([torch.int32, torch.int64, torch.int32]))
    with pytest.raises(CompileError, match=r"got \['int16'\]"):
        generate(_paged_attention_tables([torch.int16] * 3))

def test_vector_read_inputs_are_the_ones_checked_for_alignment():
    """The executor refuses misaligned inputs that a task reads in 16-byte pieces: the paged
    cache whether or not rope runs inside attention, the streamed weights; not the cos/sin
    table, which rope reads element by element."""
    from mpk.executors.codegen import aligned_inputs

    for fused in (True, False):
        tables = _paged_decode_tables(fuse_rope_attention=fused)
        names = {tables.meta["buffers"][b]["name"] for b in aligned_inputs(tables)}
        assert {"kv_cache", "layers.0.qkv", "layers.0.gate_up"} <= names and "cos_sin" not in names, names


@needs_nvcc
@pytest.mark.parametrize("name", list(GRAPHS))
def test_generated_cuda_compiles_for_sm90a(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    tables = GRAPHS[name]()
    src = generate(tables)
    assert src == generate(tables)  # deterministic
    cubin = build.build_cubin(src, "sm_90a", tile_kernel=True)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and b"mpk_persistent_kernel" in data and b"mpk_tile_kernel" in data


# qwen3-32b: groups of 8 query heads (rope + append an op of its own), hidden 5120;
# smollm2-135m: head dim 64, groups of 3, hidden 576 (no split norm); both cut to 2 layers
@needs_nvcc
@pytest.mark.parametrize("name,batch,layers", [("qwen3-0.6b", 1, None), ("qwen3-32b", 16, 2), ("smollm2-135m", 4, 2)])
def test_decode_step_kernel_has_no_register_spills(tmp_path, name, batch, layers):
    """ptxas reports no spills for decode steps' persistent kernels (the benchmark's own trace):
    local-memory traffic on a task's way in costs every hop (a Rect returned by value and
    copied through local memory, with spills around it, slows every task)."""
    import importlib.util
    import pathlib
    import re
    import sys

    bench = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))  # prebuild_decode imports decode_latency from beside it
    spec = importlib.util.spec_from_file_location("prebuild_decode", bench / "prebuild_decode.py")
    prebuild_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prebuild_decode)
    src = tmp_path / "step.cu"
    src.write_text(prebuild_decode.decode_source(name, batch, 64, 16, 0, {}, layers=layers))
    res = subprocess.run([build.nvcc_path(), *build.nvcc_flags(), *[f"-I{d}" for d in build.include_dirs()],
                          "-Xptxas", "-v", "-o", str(tmp_path / "step.cubin"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    spills = re.findall(r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                        r"(\d+) bytes spill loads", res.stderr)
    assert any(f == "mpk_persistent_kernel" for f, *_ in spills), res.stderr[-3000:]
    spilling = {f: (int(st), int(ld)) for f, _, st, ld in spills if int(st) or int(ld)}
    assert not spilling, f"ptxas spills (stores, loads bytes) in {spilling}"


def test_task_bandwidth_prebuilds_the_attention_cases(tmp_path, monkeypatch):
    """``task_bandwidth.py --prebuild --attention-only`` traces the paged attention cases on the
    CPU and builds one kernel per case into $MPK_CACHE_DIR, so that the device run finds them
    (each case's kernel differs: its head dim and whether chunks are merged)."""
    import importlib.util
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))  # task_bandwidth imports peer from beside it
    spec = importlib.util.spec_from_file_location("task_bandwidth", bench / "task_bandwidth.py")
    task_bandwidth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task_bandwidth)
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    assert task_bandwidth.main(["--prebuild", "--attention-only"]) == 0
    cubins = sorted(tmp_path.glob("*.cubin"))
    assert len(cubins) == len(task_bandwidth.ATTENTION_CASES) and len({c.read_bytes() for c in cubins}) == len(cubins)


_RED_BANKS = r"""
#include <algorithm>
#include <cstdio>
#include "mpk_tasks/linalg.cuh"
// The most accesses one bank takes in one wavefront of the linear task's partial sums: the
// fragments' float2 stores (a half-warp, lanes (g, t), per block j and row half) and the
// epilogue's reads (a warp's 32 consecutive outputs of a pass of `cols` columns, gate and up).
int main() {
  int store = 0, read = 0;
  for (int w = 0; w < 8; ++w)
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 16; h += 8)
        for (int half = 0; half < 32; half += 16) {
          int n[32] = {};
          for (int l = half; l < half + 16; ++l) {
            const int i = mpk::red_index(w, (l >> 2) + h, 8 * j + 2 * (l & 3));
            if (i % 2) return 1;  // a float2 needs 8-byte alignment
            ++n[i % 32], ++n[(i + 1) % 32];
          }
          store = std::max(store, *std::max_element(n, n + 32));
        }
  for (int cols : {COLS_LIST})
    for (int w = 0; w < 8; ++w)
      for (int up = 0; up <= (cols <= 32 ? 32 : 0); up += 32)
        for (int e0 = 0; e0 < 16 * cols; e0 += 32) {
          int n[32] = {};
          for (int e = e0; e < e0 + 32 && e < 16 * cols; ++e) ++n[mpk::red_index(w, e / cols, up + e % cols) % 32];
          read = std::max(read, *std::max_element(n, n + 32));
        }
  printf("%d %d\n", store, read);
}
"""


@needs_nvcc
@pytest.mark.parametrize("cols, worst_read", [("32, 64", 1), ("16, 24, 48, 40, 8", 2)])
def test_linear_partial_sums_layout_is_free_of_bank_conflicts(tmp_path, cols, worst_read):
    """The linear task's partial sums in shared memory (red_index, host code compiled by nvcc
    and run here): the MMA fragments' float2 stores hit 32 distinct banks, and so do the
    epilogue's reads for passes of 32 or 64 columns (all full passes); a narrower or ragged
    last pass at most 2-way. (The former [warp][column][row] layout read 16-way.)"""
    src = tmp_path / "red_banks.cu"
    src.write_text(_RED_BANKS.replace("COLS_LIST", cols))
    exe = tmp_path / "red_banks"
    res = subprocess.run([build.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                          *[f"-I{d}" for d in build.include_dirs()], "-o", str(exe), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, "a float2 store is not 8-byte aligned"
    store, read = map(int, run.stdout.split())
    assert store == 1, f"{store}-way bank conflict in the partial sums' stores"
    assert read <= worst_read, f"{read}-way bank conflict in the epilogue's reads of {cols}-column passes"


def _divisor_cases(n: int = 600) -> list[tuple[int, int]]:
    """(g, x) pairs: fresh random extents of every size up to 2^31 − 1, powers of two and their
    neighbours, each against the numerators where a rounding slip would show (0, around
    multiples of g, the top of the 32-bit range) and random ones."""
    gs = [1, 2, 3, 7, 2 ** 31 - 1] + [2 ** k + e for k in range(1, 31) for e in (-1, 0, 1)]
    gs += [random.randrange(1, 2 ** random.randint(2, 31)) for _ in range(n)]
    cases = []
    for g in gs:
        top = (2 ** 32 - 1) // g * g
        xs = [0, 1, g - 1, g, g + 1, 2 * g - 1, top - 1, top, 2 ** 32 - 1] + [random.randrange(2 ** 32) for _ in range(8)]
        cases += [(g, x) for x in xs if 0 <= x < 2 ** 32]
    return cases


def test_fast_divisor_matches_integer_division():
    """codegen.fast_divisor's (m, s): (⌊x·m/2³²⌋ + x) >> s is x // g for 32-bit x (the formula
    common.cuh's fast_div evaluates), m fits 32 bits; extents outside [1, 2³¹) are refused."""
    for g, x in _divisor_cases():
        m, s = fast_divisor(g)
        assert 0 < m < 2 ** 32
        assert (((x * m) >> 32) + x) >> s == x // g, (g, x, m, s)
    for bad in (0, -3, 2 ** 31):
        with pytest.raises(CompileError, match=str(bad)):
            fast_divisor(bad)


_FAST_DIV = r"""
#include <cstdio>
#include "mpk_tasks/common.cuh"
// Reads "g m s x" lines; prints how many fast_div(x, m, s) differ from x / g.
int main() {
  unsigned g, m, x;
  int s, bad = 0, n = 0;
  while (scanf("%u %u %d %u", &g, &m, &s, &x) == 4) {
    ++n;
    if (mpk::fast_div(x, m, s) != x / g) ++bad;
  }
  printf("%d %d\n", n, bad);
}
"""


def _run_host_program(tmp_path, source: str, stdin: str) -> str:
    """Compile ``source`` (host code that includes the task headers) with nvcc, run it here on
    ``stdin``, return its stdout: the task code's arithmetic checked on a CPU machine."""
    src = tmp_path / "program.cu"
    src.write_text(source)
    exe = tmp_path / "program"
    res = subprocess.run([build.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                          *[f"-I{d}" for d in build.include_dirs()], "-o", str(exe), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


@needs_nvcc
def test_fast_div_in_cuda_matches_integer_division(tmp_path):
    """common.cuh's fast_div (host code compiled by nvcc and run here) with codegen's magic
    numbers divides exactly: the tile bounds every task computes on its way in."""
    cases = _divisor_cases(200)
    lines = "".join(f"{g} {fast_divisor(g)[0]} {fast_divisor(g)[1]} {x}\n" for g, x in cases)
    assert _run_host_program(tmp_path, _FAST_DIV, lines).split() == [str(len(cases)), "0"]


_SPAN_FAULT = r"""
#include <cstdio>
#include "mpk_tasks/paged_attention.cuh"
// Reads "b p0 p1 tail n page_size" lines; prints span_fault's code, row, value, limit for each.
int main() {
  long long b, p0, p1, tail, n;
  int page_size;
  while (scanf("%lld %lld %lld %lld %lld %d", &b, &p0, &p1, &tail, &n, &page_size) == 6) {
    const mpk::SpanFault f = mpk::span_fault(b, p0, p1, tail, n, page_size);
    printf("%d %lld %lld %lld\n", f.code, f.row, f.value, f.limit);
  }
}
"""


@needs_nvcc
def test_page_span_check_in_cuda_agrees_with_checked_lens(tmp_path):
    """paged_attention.cuh's span_fault, which the GPU tasks apply to each sequence's kv_indptr /
    kv_last_page_len entries before they follow them, finds a fault in a table exactly where
    mpk.ops.paged.checked_lens (the eager path's check) refuses it, and names an entry that is
    wrong: fresh random tables with one entry corrupted, or none."""
    from mpk.errors import BadInputError
    from mpk.ops.paged import checked_lens

    rng = random.Random()
    tables, lines = [], []
    for _ in range(300):
        page_size, batch = 2 ** rng.randrange(9), rng.randint(1, 6)
        counts = [rng.choice([0, 1, rng.randint(1, 9)]) for _ in range(batch)]
        indptr = [0]
        for k in counts:
            indptr.append(indptr[-1] + k)
        n = indptr[-1] + rng.randint(0, 3)
        last = [rng.randint(1, page_size) if k else rng.randint(-2, page_size + 2) for k in counts]
        what = rng.choice(["none", "indptr", "last"])
        if what == "indptr":
            indptr[rng.randrange(batch + 1)] = rng.choice([-1 - rng.randrange(5), n + 1 + rng.randrange(5),
                                                           rng.randint(0, n)])
        elif what == "last":
            last[rng.randrange(batch)] = rng.choice([0, -rng.randrange(1, 4), page_size + 1 + rng.randrange(4)])
        tables.append((page_size, indptr, last, n))
        lines += [f"{b} {indptr[b]} {indptr[b + 1]} {last[b]} {n} {page_size}" for b in range(batch)]
    faults = iter(tuple(int(x) for x in line.split())
                  for line in _run_host_program(tmp_path, _SPAN_FAULT, "\n".join(lines) + "\n").splitlines())
    refused = 0
    for page_size, indptr, last, n in tables:
        found = [next(faults) for _ in last]
        for b, (code, row, value, limit) in enumerate(found):
            assert code in (0, 3, 4), code
            if code == 3:  # kBadPageSpan names the kv_indptr entry
                assert row in (b, b + 1) and value == indptr[row] and limit == n
            elif code == 4:  # kBadLastPageLen
                assert row == b and value == last[b] and limit == page_size and indptr[b + 1] > indptr[b]
        try:
            checked_lens(torch.tensor(indptr), torch.zeros(n, dtype=torch.int64), torch.tensor(last), page_size, 1)
            ok = True
        except BadInputError:
            ok = False
        assert ok == all(f[0] == 0 for f in found), (page_size, indptr, last, n, found)
        refused += not ok
    assert 50 < refused < 250  # both sides of the check were exercised
    assert next(faults, None) is None


_QO_ROWS = r"""
#include <cstdio>
#include <vector>
#include "mpk_tasks/paged_attention.cuh"
// Reads tables "T n e0 … e(n−1)" (qo_indptr of n entries for T rows); prints the first entry
// qo_entry_fault finds at fault (−1: none), then, for a table without one, each row's sequence
// (qo_sequence; −1 for a padding row).
int main() {
  long long T;
  int n;
  while (scanf("%lld %d", &T, &n) == 2) {
    std::vector<long long> qo(n);
    for (auto& x : qo) scanf("%lld", &x);
    int bad = -1;
    for (int i = 0; i < n && bad < 0; ++i)
      if (mpk::qo_entry_fault(i, qo[i], i ? qo[i - 1] : 0, T)) bad = i;
    printf("%d", bad);
    for (long long t = 0; bad < 0 && t < T; ++t) printf(" %lld", t < qo[n - 1] ? mpk::qo_sequence(qo.data(), 1, n - 1, t) : -1);
    printf("\n");
  }
}
"""


@needs_nvcc
def test_qo_checks_in_cuda_agree_with_qo_rows(tmp_path):
    """paged_table.cuh's qo_entry_fault and qo_sequence (host code compiled by nvcc and run
    here), which the ragged tasks apply to qo_indptr, agree with mpk.ops.paged.qo_rows: the same
    first entry at fault on fresh random tables with one entry corrupted (or none), and each
    row's sequence where there is none."""
    from mpk.errors import BadInputError
    from mpk.ops.paged import qo_rows

    rng = random.Random()
    tables = []
    for _ in range(300):
        counts = [rng.choice([0, 1, rng.randint(1, 9)]) for _ in range(rng.randint(1, 6))]
        qo = [0]
        for k in counts:
            qo.append(qo[-1] + k)
        T = qo[-1] + rng.randint(0, 3)
        if rng.random() < 0.5:
            qo[rng.randrange(len(qo))] = rng.choice([rng.randint(0, T + 3), -1, T + 1])
        tables.append((T, qo))
    lines = "".join(f"{T} {len(qo)} {' '.join(map(str, qo))}\n" for T, qo in tables)
    found = _run_host_program(tmp_path, _QO_ROWS, lines).splitlines()
    faults = 0
    for (T, qo), line in zip(tables, found, strict=True):
        got = [int(x) for x in line.split()]
        lens = torch.full((len(qo) - 1,), 1 << 20)
        try:
            seq, _ = qo_rows(torch.tensor(qo), lens, T)
        except BadInputError as e:
            faults += 1
            assert got[0] >= 0 and f"qo_indptr entry {qo[got[0]]} at row {got[0]} is outside" in str(e), (qo, T, e)
            continue
        assert got == [-1] + seq.tolist(), (qo, T, got)
    assert 50 < faults < 250


@needs_nvcc
def test_buffer_table_beyond_shared_memory_budget_compiles(tmp_path, monkeypatch):
    """Buffer addresses are staged into shared memory while the table fits the budget; past
    it, tasks read the bank directly, and that build compiles too."""
    from mpk.executors import codegen

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    tables = _paged_decode_tables()
    assert "__shared__ void* s[" in generate(tables)
    monkeypatch.setattr(codegen, "SMEM_BUFFERS_MAX", len(tables.buffers) - 1)
    src = generate(tables)
    assert "__shared__ void* s[" not in src and "return mpk_buffers;" in src
    assert build.build_cubin(src, "sm_90a").read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
def test_phase_timer_build_exports_its_table(tmp_path, monkeypatch):
    """benchmarks/linear_phases.py's build (-DMPK_PHASES) compiles and exports the phase table
    the script reads; the default build has none."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    src = generate(_paged_decode_tables())
    assert b"mpk_phase_ns" not in build.build_cubin(src, "sm_90a").read_bytes()
    monkeypatch.setenv("MPK_NVCC_FLAGS", "-DMPK_PHASES")
    assert b"mpk_phase_ns" in build.build_cubin(src, "sm_90a").read_bytes()


@needs_nvcc
def test_second_identical_build_skips_nvcc(tmp_path, monkeypatch, capsys):
    """A cached build runs no nvcc and says nothing; a build that runs nvcc says so on stderr
    (with progress on), and prebuild counts its builds on a progress bar."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    tables = stamp_graph(random_dag(50, random.Random(1)), iterations=2)
    src = generate(tables)
    first = build.build_cubin(src, progress=True)
    err = capsys.readouterr().err
    assert f"nvcc is building the megakernel for sm_90a (once; cached as {first})" in err
    assert re.search(r"nvcc finished in \d+\.\d s", err)
    calls = []
    real_popen = subprocess.Popen

    def spy(cmd, *a, **k):  # (subprocess.run starts its process through Popen too)
        calls.append(cmd)
        return real_popen(cmd, *a, **k)

    monkeypatch.setattr(build.subprocess, "Popen", spy)
    assert build.build_cubin(src, progress=True) == first
    assert not any("nvcc" in str(c[0]) and "--version" not in c for c in calls)
    assert capsys.readouterr().err == ""
    assert build.prebuild([src, src], progress=True) == [first, first]
    assert "nvcc: 100%" in capsys.readouterr().err and not any("--version" not in c for c in calls)
    # a different flag set is a different cache entry, also one nvcc takes from its environment
    assert build.build_cubin(src, debug=True) != first
    assert any("-DMPK_DEBUG" in c for c in calls)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DMPK_UNUSED_SWITCH")
    assert build.build_cubin(src) not in (first, build.build_cubin(src, debug=True))


@needs_nvcc
def test_concurrent_builds_of_one_source_share_the_cubin(tmp_path, monkeypatch):
    """Threads building one source at once (an executor per GPU) each get the cached cubin, no
    error and no temporary file left behind."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    src = generate(stamp_graph(random_dag(20, random.Random(2)), iterations=1))
    with ThreadPoolExecutor(3) as pool:
        cubins = list(pool.map(lambda _: build.build_cubin(src, progress=False), range(3)))
    assert len(set(cubins)) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF"
    assert sorted(p.suffix or p.name for p in tmp_path.iterdir()) == [".cu", ".cubin", ".lock", ".sha256"]


@needs_nvcc
def test_damaged_cached_cubin_is_rebuilt_and_a_cache_serves_without_nvcc(tmp_path, monkeypatch, capsys):
    """A cut cubin in the cache (an interrupted copy) and one whose bytes changed in place (its
    size and ELF headers intact) are rebuilt, not handed to the driver; with no nvcc on PATH a
    cubin of the same source is still found, and its absence is named."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    src = generate(stamp_graph(random_dag(12, random.Random(random.randrange(1 << 20))), iterations=1))
    cubin = build.build_cubin(src, progress=False)
    whole = cubin.read_bytes()
    cubin.write_bytes(whole[:random.randrange(0, len(whole) // 2)])
    assert not build._whole_elf(cubin)
    # (nvcc's output is not byte-identical between runs: compare what matters)
    assert build.build_cubin(src, progress=True) == cubin and build._whole_elf(cubin) and \
        abs(len(cubin.read_bytes()) - len(whole)) < 64
    assert "is damaged (cut short, or not the bytes that were built); rebuilding it" in capsys.readouterr().err
    flipped = bytearray(cubin.read_bytes())
    at = random.randrange(64, len(flipped))
    flipped[at] ^= 0xFF
    cubin.write_bytes(bytes(flipped))
    assert build._whole_elf(cubin) and not build._intact(cubin)
    assert build.build_cubin(src, progress=True) == cubin and build._intact(cubin)
    assert "is damaged" in capsys.readouterr().err
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    assert build.build_cubin(src) == cubin
    with pytest.raises(build.BuildError, match="nvcc was not found on PATH.*holds no cubin of this source"):
        build.build_cubin(src + "\n// another source\n")


def test_nvcc_killed_by_a_signal_is_named_and_ctrl_c_stays_an_interrupt(tmp_path, monkeypatch):
    """nvcc ended by SIGKILL (the OOM killer) is a BuildError naming the signal; by SIGINT (Ctrl-C
    in the terminal reaches nvcc too) the caller's KeyboardInterrupt, not a build error."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "nvcc_version", lambda: "fake nvcc")
    for sig, expected in ((signal.SIGKILL, build.BuildError), (signal.SIGINT, KeyboardInterrupt)):
        fake = tmp_path / f"nvcc-{sig.name}"
        # (Python, not sh: a shell started in the background ignores SIGINT and cannot undo it)
        fake.write_text(f"#!{sys.executable}\nimport os, signal\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                        f"os.kill(os.getpid(), signal.{sig.name})\n")
        fake.chmod(0o755)
        monkeypatch.setattr(build, "nvcc_path", lambda fake=fake: str(fake))
        with pytest.raises(expected) as info:
            build.build_cubin(f"// {sig.name}\n", progress=False)
        if expected is build.BuildError:
            assert "nvcc was killed by SIGKILL" in str(info.value)


def test_broken_nvcc_and_unusable_cache_are_build_errors(tmp_path, monkeypatch):
    """nvcc that fails its --version (a licence or driver problem) and a cache path that is a
    file are BuildErrors quoting the cause, not raw subprocess / OS errors."""
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'fake nvcc: licence expired' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(build, "nvcc_path", lambda: str(fake))
    build.nvcc_version.cache_clear()
    try:
        with pytest.raises(build.BuildError, match="--version failed \\(exit 3\\): fake nvcc: licence expired"):
            build.nvcc_version()
    finally:
        build.nvcc_version.cache_clear()
    monkeypatch.undo()
    if build.nvcc_path() is None:
        pytest.skip("no nvcc: the cache-directory half needs a real compiler")
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "afile"))
    with pytest.raises(build.BuildError, match=r"the cubin cache .*afile \(\$MPK_CACHE_DIR.*is not a writable directory"):
        build.build_cubin("__global__ void k() {}\n")


@needs_nvcc
def test_build_error_names_file_and_nvcc_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError) as info:
        build.build_cubin("this is not CUDA;\n", progress=True)
    assert re.search(r"nvcc failed in \d+\.\d s", capsys.readouterr().err)
    msg = str(info.value)
    assert str(tmp_path) in msg and ".cu" in msg and "error" in msg


def test_page_table_the_graph_computes_is_refused():
    """Paged attention reads its first sequence's page table before its gate opens, so a table
    the graph computes (here kv_last_page_len from another tensor) would race with its producer:
    codegen refuses it, naming the op and the tensor."""
    class Attend(torch.nn.Module):
        def forward(self, q, cache, indptr, indices, last_plus_one):
            return torch.ops.mpk.paged_attention(q, cache, indptr, indices, last_plus_one - 1, 0, 0.125, 1)

    ps, pages = 4, 6
    args = (torch.randn(2, 4, 64), torch.randn(1, 2, pages, 2, ps, 64), torch.tensor([0, 2, 5], dtype=torch.int32),
            torch.randperm(pages).int(), torch.tensor([4, 2], dtype=torch.int32))
    tables = compile_module(Attend(), args, {"num_workers": 8}).tables
    with pytest.raises(CompileError, match=r"paged attention reads kv_last_page_len before its inputs are ready"):
        generate(tables)


def test_racing_builders_leave_one_builds_cubin_and_digest(tmp_path, monkeypatch):
    """nvcc's bytes differ between runs: when several builders of one source finish, the cache
    keeps the first one's cubin and digest together (a later one's output is dropped), so the
    pair always matches; the digest is readable by others like the cubin, and no temporary
    file stays behind."""
    fake = tmp_path / "nvcc"  # writes 200 random bytes after an ELF header that passes _whole_elf
    fake.write_text(f"#!{sys.executable}\nimport os, sys, time\nout = sys.argv[sys.argv.index('-o') + 1]\n"
                    "head = bytearray(64); head[:5] = b'\\x7fELF\\x02'\n"
                    "time.sleep(0.2)\nopen(out, 'wb').write(bytes(head) + os.urandom(200))\n")
    fake.chmod(0o755)
    monkeypatch.setattr(build, "nvcc_path", lambda: str(fake))
    monkeypatch.setattr(build, "nvcc_version", lambda: "fake nvcc")
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    from concurrent.futures import ThreadPoolExecutor

    old = os.umask(0o077)
    try:
        with ThreadPoolExecutor(4) as pool:
            cubins = set(pool.map(lambda _: build.build_cubin("// racing\n", progress=False), range(4)))
    finally:
        os.umask(old)
    (cubin,) = cubins
    assert build._intact(cubin) and cubin.with_suffix(".sha256").stat().st_mode & 0o444 == 0o444
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith((".tmp", ".tmp.sha256"))]


def test_float_constants_round_once_as_torch_rounds_them():
    """A float constant is the float32 torch makes of the double (one rounding): the decimal of
    1 + 2^-24 parsed as a float would round up to 1 + 2^-23 at the tie instead."""
    from mpk.executors.codegen import _float

    assert _float(1 + 2 ** -24) == "1.0f" and _float(1 + 3 * 2 ** -24) == f"{1 + 2 ** -22!r}f"
    assert _float(1e39) == "INFINITY" and _float(-1e39) == "-INFINITY" and _float(float("nan")) == "NAN"
    assert _float(0.1) == f"{float(np.float32(0.1))!r}f"
