"""benchmarks/peer.py: the peer decode step against an independent float64 reference, the
byte counts behind the floor against public parameter counts, and (GPU) the timers."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "peer.py"
_spec = importlib.util.spec_from_file_location("peer", _PATH)
peer = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("peer", peer)  # dataclasses resolves the module of Shape by name
_spec.loader.exec_module(peer)

TOL = 1e-4  # max |peer − ref| / max |ref| for the float32 peer vs the float64 reference


def _reference_step(model, token_ids: list[int], pos: int, caches: list[list[tuple[list, list]]]) -> torch.Tensor:
    """One decode step written plainly: float64, unfused weights, per-head loops, RoPE as
    pairwise rotations of (i, i + D/2), softmax over the cached positions 0..pos (kept in
    ``caches[layer][batch]`` as lists of per-kv-head vectors)."""
    s = model.shape
    d, hq, hk = s.head_dim, s.q_heads, s.kv_heads
    group = hq // hk
    w = {n: p.detach().double() for n, p in model.named_parameters()}
    emb = model.tok_embeddings.detach().double()
    head = model.output.detach().double()

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean() + s.rms_eps) * weight

    def rope(x):
        out = x.clone()
        for i in range(d // 2):
            ang = pos * s.rope_theta ** (-2.0 * i / d)
            c, sn = math.cos(ang), math.sin(ang)
            out[i] = x[i] * c - x[i + d // 2] * sn
            out[i + d // 2] = x[i + d // 2] * c + x[i] * sn
        return out

    logits = []
    for b, tok in enumerate(token_ids):
        x = emb[tok].clone()
        for li in range(s.layers):
            p = f"layers.{li}."
            wqkv = w[p + "wqkv"]
            wq, wk, wv = wqkv[: hq * d], wqkv[hq * d: (hq + hk) * d], wqkv[(hq + hk) * d:]
            h = rms(x, w[p + "attention_norm"])
            ks, vs = caches[li][b]
            new_k, new_v = [], []
            for j in range(hk):
                k = wk[j * d: (j + 1) * d] @ h
                if s.qk_norm:
                    k = rms(k, w[p + "k_norm"])
                new_k.append(rope(k))
                new_v.append(wv[j * d: (j + 1) * d] @ h)
            ks.append(new_k)
            vs.append(new_v)
            assert len(ks) == pos + 1
            heads = []
            for i in range(hq):
                q = wq[i * d: (i + 1) * d] @ h
                if s.qk_norm:
                    q = rms(q, w[p + "q_norm"])
                q = rope(q)
                j = i // group  # GQA: consecutive query heads share a kv head
                scores = torch.stack([q @ ks[t][j] for t in range(pos + 1)]) / math.sqrt(d)
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                heads.append(sum(probs[t] * vs[t][j] for t in range(pos + 1)))
            x = x + w[p + "wo"] @ torch.cat(heads)
            h = rms(x, w[p + "ffn_norm"])
            w13 = w[p + "w13"]
            gate, up = w13[: s.inter] @ h, w13[s.inter:] @ h
            x = x + w[p + "w2"] @ (gate / (1 + torch.exp(-gate)) * up)
        logits.append(head @ rms(x, w["norm"]))
    return torch.stack(logits)


@pytest.mark.parametrize("qk_norm,tied", [(True, False), (False, True)])
def test_peer_matches_reference(qk_norm: bool, tied: bool):
    shape = dataclasses.replace(peer.SHAPES["tiny"], qk_norm=qk_norm, tied=tied)
    batch = 2
    model = peer.PeerDecoder(shape, batch, max_len=8, device="cpu", dtype=torch.float32, seed=3)
    assert all(p.abs().max() > 0 for p in model.parameters())
    caches = [[([], []) for _ in range(batch)] for _ in range(shape.layers)]
    steps = [[5, 17], [999, 0]]
    with torch.no_grad():
        for pos, toks in enumerate(steps):
            out = model(torch.tensor(toks), torch.tensor([pos]))
            assert out.shape == (batch, shape.vocab) and out.dtype == torch.float32
            ref = _reference_step(model, toks, pos, caches)
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            assert err < TOL, f"position {pos}: relative error {err:.2e}"
            # The step wrote exactly one slot per layer (the one at pos); later slots untouched.
            assert bool((model.layers[0].k_cache[:, :, pos + 1:] == 0).all())


def test_fill_cache_random_below_position():
    model = peer.PeerDecoder(peer.SHAPES["tiny"], 1, max_len=16, device="cpu", dtype=torch.float32)
    model.fill_cache_(5)
    for layer in model.layers:
        for c in (layer.k_cache, layer.v_cache):
            assert bool((c[:, :, :5] != 0).all()) and bool((c[:, :, 5:] == 0).all())


def test_weight_bytes_against_parameter_counts():
    # Qwen3-8B model card: 8.2B parameters, 6.95B without the embedding and the (untied) LM head.
    # A step reads the non-embedding weights plus the LM head once.
    q8 = peer.SHAPES["qwen3-8b"]
    card = 6.95e9 + q8.vocab * q8.hidden
    assert abs(peer.weight_bytes(q8) - 2 * card) / (2 * card) < 0.01
    # Per tensor, from the unfused HF layout: q, k, v, o, gate, up, down, 2 norms, q/k norms.
    per_layer = (q8.hidden * 32 * 128 + 2 * q8.hidden * 8 * 128 + 32 * 128 * q8.hidden
                 + 3 * q8.hidden * q8.inter + 2 * q8.hidden + 2 * 128)
    assert peer.weight_bytes(q8) == 2 * (36 * per_layer + q8.hidden + q8.vocab * q8.hidden)
    assert peer.weight_bytes(q8, dtype_bytes=4) == 2 * peer.weight_bytes(q8)
    # Llama 3.2 1B (tied): every parameter is read once; HF reports 1,235,814,400.
    assert peer.weight_bytes(peer.SHAPES["llama3.2-1b"]) == 2 * 1_235_814_400
    # The model itself (meta: no memory): its parameters, less the embedding when untied.
    for name in ("qwen3-8b", "qwen3-1.7b", "tiny"):
        s = peer.SHAPES[name]
        m = peer.PeerDecoder(s, 1, max_len=32, device="meta")
        n = sum(p.numel() for p in m.parameters()) - (0 if s.tied else s.vocab * s.hidden)
        assert peer.weight_bytes(s) == 2 * n, name
        assert peer.kv_bytes(s, 1, 32) == sum(b.numel() * b.element_size() for k, b in m.named_buffers()
                                              if k.endswith("_cache"))


def test_floor_ms():
    assert peer.floor_ms(3e9, 3e12) == pytest.approx(1.0)
    assert peer.kv_bytes(peer.SHAPES["qwen3-8b"], 4, 100) == 2 * 36 * 4 * 8 * 100 * 128 * 2


@pytest.mark.gpu
def test_time_step_and_bandwidth_gpu():
    x = torch.randn(1 << 20, device="cuda")
    ms = peer.time_step(lambda: x.mul_(1.0001), warmup=2, iters=20)
    assert isinstance(ms, float) and ms > 0
    with pytest.raises(ValueError):
        peer.time_step(lambda: None, iters=5)
    bw = peer.copy_bandwidth(nbytes=1 << 26)
    assert 1e10 < bw < 1e14


@pytest.mark.gpu
@pytest.mark.slow
def test_time_peer_tiny_gpu():
    r = peer.time_peer("tiny", batch=2, position=8)
    assert r["eager_ms"] > 0 and r["peer_ms"] == min(v for v in (r["eager_ms"], r["eager_graph_ms"],
                                                                r["compile_graph_ms"]) if v is not None)
    assert r["eager_graph_ms"] is not None, r["errors"]
    for mode, diff in r["max_rel_diff"].items():
        assert diff < 5e-2, (mode, diff)
