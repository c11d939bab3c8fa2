"""The peer and the floor the decode-latency benchmark compares mpk with.

Peer: a gpt-fast-style decode step in plain PyTorch (fused QKV and gate-up weights, static KV
cache updated in place, SDPA with a position mask), timed eager, eager under a CUDA graph, and
torch.compile + CUDA graph; the best of the three is "peer". Its prefill (``time_peer_prefill``)
runs the prompts as one padded [B, S] batch: cuBLAS GEMMs and SDPA's causal flash attention,
the same three modes (compiled once, with dynamic shapes, for every prompt length).
Floor: bytes a decode step must read (weights + KV cache) / measured device copy bandwidth.

    from peer import SHAPES, time_peer, time_peer_prefill, weight_bytes, kv_bytes, copy_bandwidth, floor_ms
    from peer import require_cuda
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def require_cuda(script: str, instead: str = "") -> None:
    """Exit naming the script when there is no CUDA device (its timings need one), rather than
    a traceback from the first CUDA call; ``instead``: what the script can do without one."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times kernels on a CUDA device, and this machine has none" +
                         (f"; {instead}" if instead else ""))


@dataclass(frozen=True)
class Shape:
    """Decoder shape as in the public configs (random weights are used for timing)."""

    name: str
    hidden: int
    inter: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    rope_theta: float
    rms_eps: float = 1e-6


# Llama 3.2's llama3 RoPE frequency scaling is not modelled: it changes the values in the cos/sin
# tables, not their shape or the work of a step, so timings do not depend on it.
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama3.2-1b", 2048, 8192, 16, 32, 8, 64, 128256, True, False, 5e5, 1e-5),
        Shape("qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151936, True, True, 1e6),
        Shape("qwen3-1.7b", 2048, 6144, 28, 16, 8, 128, 151936, True, True, 1e6),
        Shape("qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151936, False, True, 1e6),
        Shape("tiny", 256, 512, 2, 4, 2, 64, 1000, False, True, 1e6),
    )
}


def weight_bytes(shape: Shape, dtype_bytes: int = 2) -> int:
    """Bytes of all weights one decode step reads. The embedding lookup reads B rows only
    (negligible), so the [vocab, hidden] matrix counts once: as the LM head, tied or not."""
    s = shape
    attn = (s.q_heads + 2 * s.kv_heads) * s.head_dim * s.hidden + s.hidden * s.q_heads * s.head_dim
    mlp = 3 * s.inter * s.hidden
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    params = s.layers * (attn + mlp + norms) + s.hidden + s.vocab * s.hidden
    return params * dtype_bytes


def kv_bytes(shape: Shape, batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V cache (all layers) read by attention over ``seq_len`` positions."""
    return 2 * shape.layers * batch * shape.kv_heads * seq_len * shape.head_dim * dtype_bytes


def floor_ms(nbytes: int | float, bandwidth: float) -> float:
    """Lower bound in ms for reading ``nbytes`` at ``bandwidth`` bytes/s."""
    return nbytes / bandwidth * 1e3


# --------------------------------------------------------------------------------------------
# The peer model


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def tp_shape(shape: Shape, world: int) -> Shape:
    """One rank's shape at tensor-parallel degree ``world`` (q and kv heads and the MLP's inner
    size split; embedding and LM head replicated, as gpt-fast does); ValueError naming a size
    the degree does not divide."""
    for what, n in (("q_heads", shape.q_heads), ("kv_heads", shape.kv_heads), ("inter", shape.inter)):
        if n % world:
            raise ValueError(f"{shape.name}: {what}={n} is not divisible by the tensor-parallel degree {world}; "
                             "expected a degree that divides the heads, the KV heads and the MLP's inner size")
    return dataclasses.replace(shape, q_heads=shape.q_heads // world, kv_heads=shape.kv_heads // world,
                               inter=shape.inter // world)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the default process group's ranks (NCCL on GPUs): torch's
    functional all-reduce, which torch.compile traces and a CUDA graph captures."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", torch.distributed.group.WORLD)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; fp32 statistics (as HF/gpt-fast), result in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(shape: Shape, max_len: int, device: torch.device | str, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, head_dim] for the rotate-half form (frequencies repeated twice);
    computed in fp32, stored in the model dtype so the step does no casts for RoPE."""
    d = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype)


class _Block(nn.Module):
    """One decoder layer with its own static KV cache buffers."""

    def __init__(self, shape: Shape, batch: int, max_len: int, make: Callable[..., nn.Parameter],
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        s = shape
        self.s = s
        # the sum over ranks of a row-parallel projection's partial output (identity on one GPU)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.attention_norm = make(s.hidden, norm=True)
        self.wqkv = make((s.q_heads + 2 * s.kv_heads) * s.head_dim, s.hidden)
        self.wo = make(s.hidden, s.q_heads * s.head_dim)
        if s.qk_norm:
            self.q_norm = make(s.head_dim, norm=True)
            self.k_norm = make(s.head_dim, norm=True)
        self.ffn_norm = make(s.hidden, norm=True)
        self.w13 = make(2 * s.inter, s.hidden)  # rows [0, inter): gate, [inter, 2·inter): up
        self.w2 = make(s.hidden, s.inter)
        cache = (batch, s.kv_heads, max_len, s.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        s = self.s
        b = x.shape[0]
        h = _rms_norm(x, self.attention_norm, s.rms_eps)
        q, k, v = F.linear(h, self.wqkv).split(
            [s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = q.view(b, s.q_heads, 1, s.head_dim)
        k = k.view(b, s.kv_heads, 1, s.head_dim)
        v = v.view(b, s.kv_heads, 1, s.head_dim)
        if s.qk_norm:  # Qwen3: RMSNorm per head, before RoPE
            q = _rms_norm(q, self.q_norm, s.rms_eps)
            k = _rms_norm(k, self.k_norm, s.rms_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # In place at input_pos: shapes stay static, so the step can be graph-captured.
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.reduce(F.linear(o.reshape(b, s.q_heads * s.head_dim), self.wo))
        gate, up = F.linear(_rms_norm(x, self.ffn_norm, s.rms_eps), self.w13).chunk(2, dim=-1)
        return x + self.reduce(F.linear(F.silu(gate) * up, self.w2))

    def shard_(self, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keep rank ``rank``'s shard of ``world`` (Megatron, as gpt-fast's tp.py): its heads of
        q|k|v and their KV cache, its share of gate|up (column-parallel), the matching columns
        of wo and w2 (row-parallel, their outputs summed by ``reduce``)."""
        s, t = self.s, tp_shape(self.s, world)
        d, hidden = s.head_dim, s.hidden
        q, k, v = self.wqkv.split([s.q_heads * d, s.kv_heads * d, s.kv_heads * d])
        qs, ks = slice(rank * t.q_heads * d, (rank + 1) * t.q_heads * d), slice(rank * t.kv_heads * d,
                                                                                (rank + 1) * t.kv_heads * d)
        inner = slice(rank * t.inter, (rank + 1) * t.inter)
        gate, up = self.w13.split([s.inter, s.inter])

        def keep(x: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(x.contiguous(), requires_grad=False)

        self.wqkv = keep(torch.cat([q[qs], k[ks], v[ks]]).view(-1, hidden))
        self.wo, self.w13, self.w2 = keep(self.wo[:, qs]), keep(torch.cat([gate[inner], up[inner]])), \
            keep(self.w2[:, inner])
        heads = slice(rank * t.kv_heads, (rank + 1) * t.kv_heads)
        self.k_cache, self.v_cache = self.k_cache[:, heads].contiguous(), self.v_cache[:, heads].contiguous()
        self.s, self.reduce = t, reduce

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] at positions 0 … S − 1 of an empty cache: the k/v written to the
        cache, attention causal over the prompt (SDPA's flash kernel: no mask tensor)."""
        s = self.s
        b, n = x.shape[:2]
        h = _rms_norm(x, self.attention_norm, s.rms_eps)
        q, k, v = F.linear(h, self.wqkv).split(
            [s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = q.view(b, n, s.q_heads, s.head_dim).transpose(1, 2)
        k = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q = _rms_norm(q, self.q_norm, s.rms_eps)
            k = _rms_norm(k, self.k_norm, s.rms_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k_cache[:b, :, :n].copy_(k)
        self.v_cache[:b, :, :n].copy_(v)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, n, s.q_heads * s.head_dim), self.wo)
        gate, up = F.linear(_rms_norm(x, self.ffn_norm, s.rms_eps), self.w13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w2)


class PeerDecoder(nn.Module):
    """gpt-fast-style decode step: ``forward(tokens [B] int64, input_pos [1] int64) -> logits
    [B, vocab]``. Static KV cache [B, kv_heads, max_len, D] per layer (buffers ``k_cache`` /
    ``v_cache``), written at ``input_pos``; attention sees positions ≤ input_pos.

    Weights are random normal × 0.02, norm weights 1 + 0.02·randn (never zeros, which would
    make the norms' outputs and everything after them trivially zero).
    On the meta device nothing is filled (useful for counting parameters)."""

    def __init__(self, shape: Shape, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        super().__init__()
        device = torch.device(device)
        self.shape, self.batch, self.max_len = shape, batch, max_len
        fill = device.type != "meta"
        # Generate on the device itself: an 8B model never materialises on the host.
        gen = torch.Generator(device=device).manual_seed(seed) if fill else None

        def make(*size: int, norm: bool = False) -> nn.Parameter:
            t = torch.empty(size, device=device, dtype=dtype)
            if fill:
                t.normal_(0.0, 0.02, generator=gen)
                if norm:
                    t.add_(1.0)
            return nn.Parameter(t, requires_grad=False)

        s = shape
        self.tok_embeddings = make(s.vocab, s.hidden)
        self.layers = nn.ModuleList(_Block(s, batch, max_len, make, device, dtype) for _ in range(s.layers))
        self.norm = make(s.hidden, norm=True)
        # Tied: the LM head is the embedding parameter itself (one tensor, counted once).
        self.output = self.tok_embeddings if s.tied else make(s.vocab, s.hidden)
        cos, sin = _rope_tables(s, max_len, device, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("key_pos", torch.arange(max_len, device=device), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.tok_embeddings)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [1, D]: broadcasts over B, heads
        # Boolean mask over the whole static cache: True where the key position is ≤ input_pos.
        mask = (self.key_pos <= input_pos).view(1, 1, 1, self.max_len)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return F.linear(_rms_norm(x, self.norm, self.shape.rms_eps), self.output)

    def prefill(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Prompts ``tokens`` [B, S] (right-padded) into an empty cache; the logits [B, vocab] of
        each prompt's last token, at positions ``last`` [B] (causal attention keeps the padding
        after a prompt out of its rows)."""
        x = F.embedding(tokens, self.tok_embeddings)
        n = tokens.shape[1]
        cos, sin = self.rope_cos[:n], self.rope_sin[:n]  # [S, D]: broadcasts over B and heads
        for layer in self.layers:
            x = layer.prefill(x, cos, sin)
        x = x[torch.arange(x.shape[0], device=x.device), last]
        return F.linear(_rms_norm(x, self.norm, self.shape.rms_eps), self.output)

    def shard_(self, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor] = all_reduce_sum
               ) -> "PeerDecoder":
        """Keep rank ``rank``'s shard of every layer (``_Block.shard_``); the embedding, final
        norm and LM head stay whole. Every rank must have built the same full model (same seed)."""
        tp_shape(self.shape, world)  # the sizes are checked before any layer changes
        for layer in self.layers:
            layer.shard_(rank, world, reduce)
        return self

    @torch.no_grad()
    def fill_cache_(self, position: int, seed: int = 1) -> None:
        """Random K/V (scale 1, like normed keys) at positions < ``position`` in every layer."""
        if position <= 0:
            return
        gen = torch.Generator(device=self.key_pos.device).manual_seed(seed)
        for layer in self.layers:
            layer.k_cache[:, :, :position].normal_(generator=gen)
            layer.v_cache[:, :, :position].normal_(generator=gen)


# --------------------------------------------------------------------------------------------
# Timing


def _event_times_ms(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Per-call ms by CUDA events. Calls are issued back to back (no host sync between them),
    as in a decode loop, so launch overhead shows where the host is slower than the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(stop) for start, stop in events]


def time_step(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median ms per call of ``fn`` (each call timed with its own CUDA events), after warm-up."""
    if iters < 20:
        raise ValueError(f"iters={iters}: the timing is the median of >= 20 steps")
    return statistics.median(_event_times_ms(fn, warmup, iters))


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``, counting read + written (2·nbytes),
    median over 10 copies after warm-up."""
    def copy_ms() -> float:  # the 2·nbytes of buffers are freed when this returns
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        with torch.cuda.device(src.device):
            return statistics.median(_event_times_ms(lambda: dst.copy_(src), warmup=3, iters=10))

    ms = copy_ms()
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def _capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """CUDA graph of ``step`` (reading static input tensors); warm-up on a side stream first,
    as capture requires (lazy cuBLAS/Triton initialisation must not happen inside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


def _time_modes(model: Callable[..., torch.Tensor], tokens: torch.Tensor, pos: torch.Tensor, compile_mode: str,
                warmup: int, iters: int) -> tuple[dict, dict, dict, str | None, float | None]:
    """The three timings of ``model(tokens, pos)`` (a step of time_peer or time_peer_prefill);
    every graph and compiled function dies with this frame."""
    times: dict[str, float | None] = {"eager": None, "eager_graph": None, "compile_graph": None}
    errors: dict[str, str] = {}
    diffs: dict[str, float] = {}
    compile_used: str | None = None
    compile_s: float | None = None

    ref = model(tokens, pos).clone()
    times["eager"] = time_step(lambda: model(tokens, pos), warmup, iters)

    try:
        graph, out = _capture(lambda: model(tokens, pos))
        times["eager_graph"] = time_step(graph.replay, warmup, iters)
        diffs["eager_graph"] = _rel_diff(out, ref)
        del graph, out
    except Exception as e:  # noqa: BLE001 - a failed mode is reported, not fatal
        errors["eager_graph"] = _error(e)

    # Modes with Inductor's own CUDA graphs (cudagraph trees) must not be captured again by hand.
    own_graphs = compile_mode in ("reduce-overhead", "max-autotune")
    if not own_graphs:
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(model, mode=compile_mode, fullgraph=True)
            graph, out = _capture(lambda: compiled(tokens, pos))
            compile_s = time.perf_counter() - t0
            times["compile_graph"] = time_step(graph.replay, warmup, iters)
            diffs["compile_graph"] = _rel_diff(out, ref)
            compile_used = f"{compile_mode} + manual CUDA graph"
            del graph, out
        except Exception as e:  # noqa: BLE001
            errors["compile_graph"] = _error(e)
            torch._dynamo.reset()
    if times["compile_graph"] is None:
        # Also the fallback when the manual capture failed: Inductor's cudagraph trees.
        tree_mode = compile_mode if own_graphs else "reduce-overhead"
        t0 = time.perf_counter()
        try:
            compiled_cg = torch.compile(model, mode=tree_mode, fullgraph=True)

            def step() -> torch.Tensor:
                # Each call starts a new "iteration" for cudagraph trees (outputs reused).
                torch.compiler.cudagraph_mark_step_begin()
                return compiled_cg(tokens, pos)

            for _ in range(3):  # the first calls compile and record the graph
                step()
            compile_s = time.perf_counter() - t0
            times["compile_graph"] = time_step(step, warmup, iters)
            diffs["compile_graph"] = _rel_diff(step(), ref)
            compile_used = tree_mode
        except Exception as e:  # noqa: BLE001
            errors[f"compile_graph_{tree_mode}"] = _error(e)
    return times, errors, diffs, compile_used, compile_s


def time_peer(shape: Shape | str, batch: int, position: int = 64, max_len: int | None = None,
              device: torch.device | str = "cuda", *, compile_mode: str = "default",
              warmup: int = 5, iters: int = 30, seed: int = 0, tp: tuple[int, int] | None = None) -> dict:
    """Time the peer's decode step at ``position`` (cache filled with random K/V below it):
    eager, eager under a CUDA graph, torch.compile + CUDA graph. A mode that fails is recorded
    in ``errors`` (and its time is None) instead of raising; eager failing raises.

    ``max_len`` (static cache length, which the masked SDPA reads in full) defaults to
    position + 1 rounded up to 16; use kv_bytes(shape, batch, result["max_len"]) for the floor.
    compile + graph: torch.compile(``compile_mode``, fullgraph) captured by hand in a CUDA graph;
    if that fails (or for "reduce-overhead" / "max-autotune"), Inductor's own CUDA graphs.
    "default" is the default: it is as fast as reduce-overhead here, and max-autotune's picks
    vary from run to run while costing minutes more of compilation.
    ``max_rel_diff`` compares each graph mode's logits with eager's (a broken capture shows).
    ``tp``: (rank, world) of a torch.distributed job (NCCL): this rank's shard, its row-parallel
    outputs all-reduced (``PeerDecoder.shard_``); every rank calls this in lockstep."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if max_len is None:
        max_len = -(-(position + 1) // 16) * 16  # 16-aligned: SDPA's mask-capable kernels want it
    if not 0 <= position < max_len:
        raise ValueError(f"position {position} outside the cache of {max_len}")
    device = torch.device(device)
    model = PeerDecoder(shape, batch, max_len, device, seed=seed).eval()
    if tp is not None and tp[1] > 1:
        model.shard_(*tp)
    try:
        model.fill_cache_(position, seed=seed + 1)
        gen = torch.Generator(device=device).manual_seed(seed + 2)
        tokens = torch.randint(0, shape.vocab, (batch,), device=device, generator=gen)
        pos = torch.tensor([position], device=device, dtype=torch.long)
        with torch.no_grad(), torch.cuda.device(device):
            times, errors, diffs, compile_used, compile_s = _time_modes(model, tokens, pos, compile_mode,
                                                                         warmup, iters)
    finally:
        # The caller times several models in one process: drop the weights (and Dynamo's
        # references to the module) before emptying the allocator's cache.
        del model
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()

    available = {k: v for k, v in times.items() if v is not None}
    mode = min(available, key=available.get) if available else None
    return {
        "shape": shape.name, "batch": batch, "position": position, "max_len": max_len,
        "eager_ms": times["eager"], "eager_graph_ms": times["eager_graph"],
        "compile_graph_ms": times["compile_graph"],
        "peer_ms": available[mode] if mode else None, "peer_mode": mode,
        "compile_mode": compile_used, "compile_s": compile_s,
        "max_rel_diff": diffs, "errors": errors,
    }


def time_peer_prefill(shape: Shape | str, cases: list[list[int]], device: torch.device | str = "cuda", *,
                      compile_mode: str = "default", warmup: int = 3, iters: int = 20, seed: int = 0) -> list[dict]:
    """Time the peer's prefill of each case's prompts (their lengths; one padded batch into an
    empty cache, the last token's logits of each): eager, eager under a CUDA graph, and
    torch.compile (compiled once with dynamic shapes for every case, as a server compiles its
    prefill) under a CUDA graph; the best is "peer". One result per case, with ``time_peer``'s keys
    (``lengths`` in place of position)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if not cases or min(min(c) for c in cases) < 1:
        raise ValueError(f"cases {cases}; expected lists of prompt lengths ≥ 1")
    device = torch.device(device)
    longest = max(max(c) for c in cases)
    model = PeerDecoder(shape, max(len(c) for c in cases), -(-longest // 16) * 16, device, seed=seed).eval()
    results = []
    try:
        gen = torch.Generator(device=device).manual_seed(seed + 2)
        t0 = time.perf_counter()
        compiled = torch.compile(model.prefill, mode=compile_mode, fullgraph=True, dynamic=True)
        for lengths in cases:
            tokens = torch.randint(0, shape.vocab, (len(lengths), max(lengths)), device=device, generator=gen)
            last = torch.tensor(lengths, device=device) - 1
            times: dict[str, float | None] = dict.fromkeys(("eager", "eager_graph", "compile_graph"))
            errors: dict[str, str] = {}
            diffs: dict[str, float] = {}
            with torch.no_grad(), torch.cuda.device(device):
                ref = model.prefill(tokens, last).clone()
                times["eager"] = time_step(lambda m=model, t=tokens, n=last: m.prefill(t, n), warmup, iters)
                for mode, fn in (("eager_graph", model.prefill), ("compile_graph", compiled)):
                    try:
                        graph, out = _capture(lambda f=fn, t=tokens, n=last: f(t, n))
                        times[mode] = time_step(graph.replay, warmup, iters)
                        diffs[mode] = _rel_diff(out, ref)
                        del graph, out
                    except Exception as e:  # noqa: BLE001 - a failed mode is reported, not fatal
                        errors[mode] = _error(e)
            available = {k: v for k, v in times.items() if v is not None}
            mode = min(available, key=available.get)
            results.append({"shape": shape.name, "lengths": list(lengths), "eager_ms": times["eager"],
                            "eager_graph_ms": times["eager_graph"], "compile_graph_ms": times["compile_graph"],
                            "peer_ms": available[mode], "peer_mode": mode, "compile_mode": f"{compile_mode}, dynamic",
                            "compile_s": time.perf_counter() - t0 if len(results) == 0 else None,
                            "max_rel_diff": diffs, "errors": errors})
    finally:
        del model
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return results
