"""Whole models through ``torch.compile(backend="mpk", options={"executor": "cpu"})`` against
eager PyTorch: 2-layer Llama- and Qwen3-style decoders (prefill with causal attention and a
decode step over a static cache) and a GELU/LayerNorm MLP block. fp32 random weights; the
tolerance is 1e-5 relative to the reference's largest |value|."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.testing.decode import random_decode_step, random_decoder
from mpk.testing.graphs import op_forms, relative_error
from mpk.testing.toy_models import LLAMA, QWEN3, Config, GeluMLPBlock, randomize

TOL = 1e-5


def _compile(model, **options):
    return torch.compile(model, backend="mpk", options={"executor": "cpu", **options})


@pytest.mark.parametrize("config", [LLAMA, QWEN3, Config(kv_heads=4)], ids=["llama", "qwen3", "mha"])
@pytest.mark.parametrize("batch,seq", [(1, 5), (3, 4)])
def test_decoder_prefill_matches_eager(config, batch, seq):
    model, ids, cos, sin = random_decoder(config, seed=1000 * batch + seq, batch=batch, seq=seq)
    with torch.no_grad():
        ref = model(ids, cos, sin)
        out = _compile(model, num_workers=16, seed=batch)(ids, cos, sin)
    assert relative_error(out, ref) <= TOL
    kinds = {op.kind for op in COMPILED[-1].graph.ops}
    assert {"rms_norm", "rope", "silu_mul", "attention", "matmul", "embedding"} <= kinds
    # GQA reads the kv heads in place (HF repeat_kv is undone, nothing materialises repeats)
    for op in COMPILED[-1].graph.ops:
        if op.kind == "attention":
            assert op.inputs[1].shape[1] == op.inputs[2].shape[1] == config.kv_heads


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_decoder_decode_step_matches_eager(config):
    """One token over a 9-entry cache (cat + non-causal GQA attention), batch 2."""
    model, ids, cos, sin, past = random_decode_step(config, seed=7)
    with torch.no_grad():
        ref = model(ids, cos, sin, past)
        out = _compile(model, num_workers=32)(ids, cos, sin, past)
    assert relative_error(out, ref) <= TOL


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_layernorm_mlp_matches_eager(approximate):
    g = torch.Generator().manual_seed(3)
    model = randomize(GeluMLPBlock(approximate=approximate), g).eval()
    x = torch.randn(4, 6, 48, generator=g)
    with torch.no_grad():
        ref = model(x)
        out = _compile(model, num_workers=12, partition={"matmul": {-1: 3}})(x)
    assert relative_error(out[0], ref[0]) <= TOL
    assert relative_error(out[1], ref[1]) <= TOL
    assert torch.equal(out[2], ref[2])


def test_many_schedules_same_result():
    """The interpreter's schedule seed changes the order of tasks, never the values."""
    model, ids, cos, sin = random_decoder(QWEN3, seed=11, batch=2, seq=3)
    with torch.no_grad():
        ref = model(ids, cos, sin)
        _compile(model, num_workers=16)(ids, cos, sin)
    from mpk.compiler.tables import place_tables
    from mpk.executors import Interpreter

    compiled = COMPILED[-1]
    interp = Interpreter(place_tables(compiled.tables, 5))
    flat = _flat_args(compiled, model, ids, cos, sin)
    outs = [interp.run(flat, seed=s)[0] for s in range(20)]
    for o in outs:
        assert relative_error(o, ref) <= TOL


def _flat_args(compiled, model, ids, cos, sin):
    """The compiled graph's inputs in placeholder order, by name."""
    named = {k: v.detach() for k, v in model.named_parameters()}
    named.update({"ids": ids, "cos": cos, "sin": sin})
    out = []
    for b in compiled.graph.inputs:
        out.append(named[b.name])
    return out


class _FusedGateUpMLP(torch.nn.Module):
    """A SwiGLU MLP with one gate·up weight (gpt-fast / mpk DecoderLM layout)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.inter = inter

    def forward(self, x):
        h = self.gate_up(x)
        return x + self.down(torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter:])


@pytest.mark.parametrize("partition", [{}, {"matmul_silu_mul_default": [2, 5]}])
def test_gate_up_projection_takes_silu_mul_as_epilogue(partition):
    """gate·up projection + SiLU·mul of its halves → one matmul with the silu_mul epilogue (no
    silu_mul op, no gate·up buffer), equal to eager in fp32 for the default tiling and tiles that split rows and columns."""
    g = torch.Generator().manual_seed(7 + len(partition))
    mlp = randomize(_FusedGateUpMLP(24, 40), g)
    x = torch.randn(3, 24, generator=g)
    with torch.no_grad():
        out = _compile(mlp, partition=partition)(x)
        ref = mlp(x)
    assert relative_error(out, ref) <= TOL
    kinds = op_forms(COMPILED[-1].graph)
    assert kinds.count("matmul_silu_mul") == 1 and "silu_mul" not in kinds


@pytest.mark.parametrize("silu", [False, True])
def test_rms_norm_matmul_in_bf16_equals_the_unfused_norm_and_projection(silu):
    """The fused RMSNorm + projection keeps the unfused pair's roundings: in bf16 its output
    equals rms_norm then the projection [+ SiLU·mul] exactly, and its float64 definition
    within one bf16 rounding (units of the reference's largest |value|), on rows whose rstd is
    far from 1."""
    g = torch.Generator().manual_seed(11 + silu)
    m, k, n = 4, 512, 96
    x = (5 * torch.randn(m, k, generator=g)).bfloat16()
    w = (1 + 0.2 * torch.randn(k, generator=g)).bfloat16()
    b = (torch.randn(k, 2 * n if silu else n, generator=g) / k ** 0.5).bfloat16()
    out = torch.ops.mpk.rms_norm_matmul(x, w, 1e-6, torch.float32, torch.bfloat16, b, silu)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    norm = torch.ops.mpk.rms_norm(x, w, 1e-6, torch.float32, torch.bfloat16)
    unfused = torch.ops.mpk.matmul_silu_mul(norm, b) if silu else norm @ b
    assert torch.equal(out, unfused)
    xd = x.double()
    h = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().double() * w.double()
    h = h.bfloat16().double() @ b.double()
    if silu:
        h = h.bfloat16().double()
        h = torch.nn.functional.silu(h[:, :n]).bfloat16().double() * h[:, n:]
    assert relative_error(out.double(), h) <= 2 ** -8


class _NormProjection(torch.nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(k), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(torch.ops.mpk.rms_norm(x, self.w, 1e-6, torch.float32, torch.float32), self.b)


@pytest.mark.parametrize("rows,k,fused", [(1, 2048, True), (2, 1024, True), (2, 1056, False), (8, 256, True),
                                          (1, 4096, False)])
def test_norm_prologue_fuses_only_what_a_task_keeps_on_chip(rows, k, fused):
    """fuse_norm_prologue fuses an RMSNorm into its projection only while all of x fits the
    task's shared-memory tile (mpk.ops.linalg.NORM_TILE_BYTES, 8 KiB: fp32 rows × k × 4 here);
    larger inputs keep the separate norm. Either way the result equals eager."""
    from mpk.ops.linalg import NORM_TILE_BYTES

    assert (rows * k * 4 <= NORM_TILE_BYTES) == fused
    mod = _NormProjection(k, 40)
    x = torch.randn(rows, k)
    with torch.no_grad():
        out = _compile(mod, fuse_norm_prologue=True)(x)
        ref = mod(x)
    assert relative_error(out, ref) <= TOL
    kinds = op_forms(COMPILED[-1].graph)
    assert kinds == (["rms_norm_matmul"] if fused else ["rms_norm", "matmul"])


@pytest.mark.parametrize("silu,group", [(False, 16), (True, 16), (False, 8), (True, 8)])
def test_norm_split_between_projections_matches_float64(silu, group):
    """matmul_norm_stats + norm_stats_matmul (an RMSNorm split between the residual projection before
    it and the projection after it) against float64: h = r + a @ w within a bf16 rounding, the
    packed sums (groups of 16 or 8 columns) equal to Σh² of the rounded h (fp32, relative 1e-6),
    and the projection within a bf16 rounding of its float64 definition with the op's roundings
    (rows whose rstd is far from 1); a group size the tasks do not take is refused."""
    from mpk.frontend.fused_ops import norm_stats_parts

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    m, k, n, out = 5, 384, 512, 96
    a = torch.randn(m, k, generator=g).bfloat16()
    w = (3 * torch.randn(k, n, generator=g) / k ** 0.5).bfloat16()
    r = (4 * torch.randn(m, n, generator=g)).bfloat16()
    nw = (1 + 0.2 * torch.randn(n, generator=g)).bfloat16()
    b = (torch.randn(n, 2 * out if silu else out, generator=g) / n ** 0.5).bfloat16()
    packed = torch.ops.mpk.matmul_norm_stats(a, w, r, nw, group)
    assert packed.shape == (3, m, n // group, group) and packed.dtype == torch.bfloat16
    h, hg, sums = norm_stats_parts(packed)
    h64 = a.double() @ w.double() + r.double()
    assert relative_error(h.double(), h64) <= 2 ** -8
    assert torch.equal(hg, (h.float() * nw.float()).bfloat16())
    group_sums = sums.contiguous().view(torch.float32)[:, ::group // 2].double()
    ref_sums = h.double().pow(2).view(m, n // group, group).sum(-1)
    assert ((group_sums - ref_sums).abs() / ref_sums).max() <= 1e-6
    assert torch.count_nonzero(sums.contiguous().view(torch.float32).view(m, n // group, group // 2)[..., 1:]) == 0
    y = torch.ops.mpk.norm_stats_matmul(packed, b, 1e-6, silu)
    assert y.shape == (m, out) and y.dtype == torch.bfloat16
    hd = h.double()  # the op's roundings: h·g and (with silu) gate, up and silu(gate) to bf16
    ref = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * (hg.double() @ b.double())
    if silu:
        ref = ref.bfloat16().double()
        ref = torch.nn.functional.silu(ref[:, :out]).bfloat16().double() * ref[:, out:]
    assert relative_error(y.double(), ref) <= 2 ** -8
    with pytest.raises(ValueError, match=r"float32 \[5, 512\]; expected a 2-byte dtype"):
        torch.ops.mpk.matmul_norm_stats(a.float(), w.float(), r.float(), nw.float(), group)
    with pytest.raises(ValueError, match=r"group=4; expected one of \(16, 8\)"):
        torch.ops.mpk.matmul_norm_stats(a, w, r, nw, 4)


@pytest.mark.parametrize("rows,n,workers,group", [
    (1, 2560, 128, 8), (16, 3072, 128, 8),  # 16- and 32-column tiles of 16-column groups; 16 and 24 of 8
    (16, 4096, 128, 16), (1, 2048, 128, 16),  # whole groups either way: the tiles are as wide
    (1, 5120, 128, 8), (12, 5120, 128, 8),  # 32 and 48 columns against 40
    (13, 5120, 128, 16)])  # 8-column groups' sums (13 × 640) would not fit the consumer's shared memory
def test_stats_group_takes_the_evener_split_that_fits(rows, n, workers, group):
    """The norm split's group size (mpk.ops.linalg.stats_group): 8 columns where 16-column
    groups would leave some tiles wider, unless the consuming task's sums then overflow its
    shared memory."""
    from mpk.ops.linalg import stats_group

    assert stats_group(rows, n, workers) == group
