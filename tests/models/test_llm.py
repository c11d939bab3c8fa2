"""The LLM layer on the CPU: the ⊕ merge's algebra, paged attention against dense softmax
attention, Llama/Qwen3 DecoderLM against Hugging Face transformers (same safetensors weights,
teacher-forced decoding), and the compiled decode step against mpk's eager path."""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mpk.backend import COMPILED
from mpk.errors import MpkError
from mpk.frontend.fused_ops import paged_attention
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, rope_inv_freq
from mpk.ops.paged import MIN_CHUNK, chunk_bounds, merge_states
from mpk.testing.decode import (
    LLAMA3_SCALING,
    against_eager_and_float32,
    check_arguments_inside_storage,
    dense_paged_attention,
    norm_fusions,
    random_page_table,
    small_config,
)
from mpk.testing.graphs import op_forms, relative_error
from mpk.testing.parity import compare_logits, decode_logits, hf_logits, hf_twin

pytest.importorskip("transformers")
small = small_config


def _random_state(n: int, d: int, g: torch.Generator, empty_share: float = 0.3):
    o = torch.randn(n, d, generator=g, dtype=torch.float64)
    lse = 5 * torch.randn(n, generator=g, dtype=torch.float64)
    empty = torch.rand(n, generator=g) < empty_share
    return torch.where(empty[:, None], 0.0, o), torch.where(empty, -math.inf, lse)


def test_merge_is_commutative_associative_with_identity():
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    a, b, c = (_random_state(64, 8, g) for _ in range(3))
    ident = (torch.zeros(64, 8, dtype=torch.float64), torch.full((64,), -math.inf, dtype=torch.float64))
    ab, ba = merge_states(*a, *b), merge_states(*b, *a)
    assert torch.allclose(ab[0], ba[0], rtol=1e-12, atol=1e-12) and torch.equal(ab[1], ba[1])
    left, right = merge_states(*merge_states(*a, *b), *c), merge_states(*a, *merge_states(*b, *c))
    assert torch.allclose(left[0], right[0], rtol=1e-10, atol=1e-12)
    assert torch.allclose(left[1], right[1], rtol=1e-12, atol=1e-12)
    for x in (a, b):
        e = merge_states(*x, *ident)
        assert torch.equal(e[0], x[0]) and torch.equal(e[1], x[1])
    empty = merge_states(*ident, *ident)  # the empty set merged with itself: no NaN
    assert not empty[0].isnan().any() and torch.isneginf(empty[1]).all() and (empty[0] == 0).all()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_paged_attention_matches_dense(page_size, heads, kv_heads, splits):
    """Lengths 1, odd, one full page and partially filled last pages; pages in a shuffled
    order; more chunks than a short sequence uses (empty chunks), and a long one in three."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    lens = [1, 7, page_size, 2 * page_size + 3, 2 * MIN_CHUNK + 45]
    pages, indptr, indices, last, num_pages = random_page_table(lens, page_size, g, spare=3)
    cache = torch.randn(2, 2, num_pages, kv_heads, page_size, 16, generator=g)
    q = torch.randn(len(lens), heads, 16, generator=g)
    out = paged_attention(q, cache, indptr, indices, last, 1, 0.25, splits)
    ref = dense_paged_attention(q, cache, lens, pages, page_size, 1, 0.25)
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("rope", [False, True])
def test_chunks_cover_each_position_once_and_none_is_short(rope):
    """chunk_bounds: the C chunks of a sequence cover its cache positions (all but the token
    being decoded under rope) in order, each exactly once; only one chunk is ever shorter than
    MIN_CHUNK positions — one in use, the others empty — and no more than C are used."""
    for n in [0, 1, 2, 127, 128, 129, 255, 256, 577, 1000, 2049, 5000]:
        m = max(0, n - rope)
        for C in [1, 2, 3, 5, 8, 16]:
            bounds = [chunk_bounds(n, c, C, rope) for c in range(C)]
            assert [t for b in bounds for t in range(*b)] == list(range(m)), (n, C)
            used = [t1 - t0 for t0, t1 in bounds if t1 > t0]
            assert len(used) <= C and (len(used) <= 1 or min(used) >= MIN_CHUNK), (n, C, used)
            if m >= MIN_CHUNK * C:
                assert len(used) == C  # a long sequence takes every chunk
            assert len(used) == (min(C, max(1, m // MIN_CHUNK)) if m else 0), (n, C, used)


def test_cuda_chunks_use_the_python_chunk_length():
    """split_chunk (CUDA) and chunk_bounds (Python, the interpreter's) split by one minimum
    chunk length: the header's kMinChunk is MIN_CHUNK."""
    header = (Path(__file__).resolve().parents[2] / "cuda" / "mpk_tasks" / "paged_attention.cuh").read_text()
    found = re.findall(r"constexpr long long kMinChunk = (\d+);", header)
    assert found == [str(MIN_CHUNK)], found


def test_default_chunk_counts():
    """default_splits: one chunk (no merge op) for a cache under 2 · MIN_CHUNK positions; a
    wave of tasks with chunks of 2 · MIN_CHUNK; half a wave with chunks of MIN_CHUNK where
    that is more and a sequence short of the capacity fills them (4 chunks at batch 1 for a
    640-position cache, 8 and 4 at batches 1 and 4 for 2112 positions)."""
    from mpk.frontend.fused_ops import default_splits

    assert default_splits(1, 8, 64 + 64) == default_splits(16, 2, 2 * MIN_CHUNK) == 1
    assert default_splits(1, 8, 640) == 4 and default_splits(4, 8, 640) == 2
    assert default_splits(1, 8, 2112) == 8 and default_splits(4, 8, 2112) == 4
    assert default_splits(1, 8, 8192) == 16 and default_splits(16, 8, 8192) == 1
    for batch, kv, cap in [(1, 8, 640), (1, 4, 1000), (2, 8, 5000), (3, 2, 300)]:
        C = default_splits(batch, kv, cap)
        assert batch * kv * C <= 128 and (C == 1 or (cap - 1) // C >= MIN_CHUNK), (batch, kv, cap, C)


@pytest.mark.parametrize("workers", [128, 4, 2])
def test_default_chunk_count_follows_the_compile_workers(workers):
    """The chunk count the compiler picks (num_splits 0) is sized to the compile's num_workers
    (it once assumed 128 whatever the option said): batch 1, 2 kv heads, a 640-position cache
    gives 4 chunks on 128 workers, 2 on 4, 1 (no merge op) on 2; the step still matches eager."""
    from mpk.frontend.fused_ops import default_splits

    cfg = small("qwen3", max_position=1024)
    model = DecoderLM(cfg, torch.float32, num_splits=0).randomize(seed=random.randrange(1 << 30))
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", "num_workers": workers})
    eager_kv, mpk_kv = PagedKVCache(model, 1, 640, 16), PagedKVCache(model, 1, 640, 16)
    tokens = torch.randint(0, cfg.vocab, (1,))
    length = 300 + random.randrange(200)  # the chunks a sequence fills: up to (length − 1) // 128
    with torch.no_grad():
        eager_kv.cache.copy_(torch.randn_like(eager_kv.cache))  # earlier positions: fresh random K/V
        mpk_kv.cache.copy_(eager_kv.cache)
        eager_kv.grow(length)
        mpk_kv.grow(length)
        assert relative_error(step(tokens, *mpk_kv.args()), model(tokens, *eager_kv.args())) <= 1e-5
    expected = {128: 4, 4: 2, 2: 1}[workers]
    assert default_splits(1, cfg.kv_heads, 640, workers) == expected
    graph = COMPILED[-1].graph
    partial = next(op for op in graph.ops if op.kind in ("rope_attn_partial", "attn_partial"))
    shape = graph.buffers[partial.output].shape
    assert (shape[2] if len(shape) == 5 else 1) == expected, shape
    assert sum(op.kind == "attn_merge" for op in graph.ops) == (cfg.layers if expected > 1 else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_chunk_attention_writes_what_the_merge_would(dtype):
    """With one chunk per sequence attn_partial writes O itself ('final', no merge op): equal
    bit for bit to merging its one state with attn_merge, an empty sequence included (0)."""
    from mpk.ir.regions import full_rect
    from mpk.ops.registry import OpSig, get_op

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    lens = [0, 1, 9, 21]
    pages, indptr, indices, last, num_pages = random_page_table(lens, 4, g, spare=1)
    cache = torch.randn(1, 2, num_pages, 2, 4, 16, generator=g).to(dtype)
    q = torch.randn(len(lens), 8, 16, generator=g).to(dtype)
    ins = [q, cache, indptr, indices, last]
    shapes = tuple(tuple(t.shape) for t in ins)
    attrs = dict(layer=0, scale=0.25, page_size=4)
    part = get_op("attn_partial")
    states_sig = OpSig(shapes, (4, 2, 1, 4, 17), torch.float32, {**attrs, "final": False})
    states = part.cpu(states_sig, full_rect(states_sig.out_shape), ins)
    merge_sig = OpSig((states_sig.out_shape,), (4, 8, 16), dtype, {})
    merged = get_op("attn_merge").cpu(merge_sig, full_rect(merge_sig.out_shape), [states])
    final_sig = OpSig(shapes, (4, 2, 4, 16), dtype, {**attrs, "final": True})
    final = part.cpu(final_sig, full_rect(final_sig.out_shape), ins)
    assert final.dtype == dtype and torch.equal(final.reshape(4, 8, 16), merged)
    assert (final[0] == 0).all() and not final.isnan().any()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_decode_matches_transformers(family):
    """fp32: every teacher-forced step within 1e-5 of transformers (relative to max |logit|)."""
    hf, ours = hf_twin(small(family), seed=random.randrange(1 << 30), dtype=torch.float32)
    tokens = torch.randint(0, 97, (3, 24))
    stats = compare_logits(decode_logits(ours, ours, tokens, page_size=4), hf_logits(hf, tokens))
    assert stats["max_rel"] <= 1e-5 and stats["top1"] == 1.0, stats


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_decode_agrees_with_transformers(family):
    """bf16, 64 teacher-forced steps against transformers' float32 logits (same weights):
    top-1 agreement ≥ 99% where the reference is decisive (see ``compare_logits``), logits
    within 5% of the largest |logit|, and a median error within 1.25× of transformers' own
    bf16 run's (over 60 seeded trials the ratio stayed in 0.90–1.04)."""
    hf, ours = hf_twin(small(family), seed=random.randrange(1 << 30), dtype=torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 64))
    ref_bf16 = hf_logits(hf, tokens)
    ref = hf_logits(hf.float(), tokens)
    stats = compare_logits(decode_logits(ours, ours, tokens, page_size=8), ref)
    hf_own = compare_logits(ref_bf16, ref)
    print(f"{family} bf16 vs transformers fp32: {stats}; transformers bf16 vs fp32: {hf_own}")
    assert stats["top1_decisive"] >= 0.99 and stats["max_rel"] <= 0.05, stats
    assert stats["decisive_share"] >= 0.25, stats  # the decisive positions are not a handful
    assert stats["median_rel"] <= 1.25 * hf_own["median_rel"], (stats, hf_own)


def test_hf_mha_without_qk_norm_config_roundtrip():
    cfg = small("llama", heads=4, kv_heads=4, tied=False)
    back = LLMConfig.from_hf(cfg.to_hf())
    assert back == cfg and back.rope_scaling == cfg.rope_scaling


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"vocab_size": None}, "lacks vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; expected 'silu'"),
    ({"attention_bias": True}, "projection biases"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "layers 1 use sliding-window"),
    # transformers' Qwen3 default: sliding from layer 28 when the config does not say
    ({"use_sliding_window": True, "sliding_window": 64, "num_hidden_layers": 30}, "layers 28, 29 use sliding-window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layers 0 use sliding-window"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"model_type": "llama", "head_dim": None, "hidden_size": 30},  # (Qwen3's head_dim defaults to 128)
     "hidden_size 30 is not a multiple of num_attention_heads 4"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling lacks 'low_freq_factor'"),
    ({"num_attention_heads": 0}, "num_attention_heads 0; expected a positive integer"),
    ({"num_key_value_heads": -2}, "num_key_value_heads -2; expected a positive integer"),
    ({"hidden_size": 64.5}, "hidden_size 64.5; expected a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers True; expected a positive integer"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps -1e-06; expected a positive number"),
    ({"rope_theta": 0.0}, "rope_theta 0.0; expected a positive number"),
    ({"rope_scaling": "linear"}, "rope_scaling 'linear'; expected a JSON object"),
    # two sources of the rope that disagree: transformers' pick depends on its version
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     "rope_parameters.rope_theta 500000.0 and rope_theta 1000000.0 differ; expected one rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": LLAMA3_SCALING},
     "rope_parameters {'rope_type': 'default', 'rope_theta': 1000000.0} and rope_scaling {'rope_type': 'llama3'"),
    ({"rope_scaling": LLAMA3_SCALING | {"factor": "8"}}, "rope_scaling: factor '8'; expected a positive number"),
    ({"rope_scaling": LLAMA3_SCALING | {"factor": 0}}, "rope_scaling: factor 0; expected a positive number"),
    ({"rope_scaling": LLAMA3_SCALING | {"high_freq_factor": 1.0}},
     "rope_scaling high_freq_factor 1.0 is not above low_freq_factor 1.0"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings 'false'; expected true or false"),
])
def test_configs_it_would_not_compute_faithfully_are_refused(tmp_path, change, message):
    """Each field that would change what the model computes, if mpk ignored it, is a named
    ConfigError (with the config's path when read from a file); the unchanged config loads."""
    from mpk.errors import ConfigError

    cfg = small("qwen3", heads=4, kv_heads=2).to_hf()
    assert LLMConfig.from_hf(cfg) == small("qwen3", heads=4, kv_heads=2)
    bad = {k: v for k, v in (cfg | change).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        LLMConfig.from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_unreadable_config_json_is_named(tmp_path):
    from mpk.errors import ConfigError

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'config.json'} is not valid JSON")):
        LLMConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list; expected a JSON object"):
        LLMConfig.from_hf(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fields_a_config_leaves_out_take_transformers_defaults(family):
    """A minimal config.json means what transformers reads it as: Qwen3's head_dim 128 and 32 kv
    heads, each family's max_position_embeddings and eps (a different default would build
    another model, or refuse a checkpoint transformers loads)."""
    import transformers

    heads = random.choice([32, 64])
    minimal = dict(model_type=family, hidden_size=heads * 2, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=heads, vocab_size=97)
    ours, hf = LLMConfig.from_hf(minimal), transformers.AutoConfig.for_model(**minimal)
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.head_dim, ours.kv_heads, ours.max_position, ours.eps, ours.rope_theta) == \
        (hf_head_dim, hf.num_key_value_heads, hf.max_position_embeddings, hf.rms_norm_eps, 10000.0)
    assert ours.head_dim == (128 if family == "qwen3" else 2)


def test_transformers_own_configs_load():
    """Configs as transformers writes them (all defaults spelled out, Qwen3's layer_types,
    Llama 3's rope parameters) are accepted and read back as the model they describe."""
    import transformers

    for family in ("qwen3", "llama"):
        ours = small(family, heads=4, kv_heads=2, tied=False)
        hf = transformers.AutoConfig.for_model(**ours.to_hf()).to_dict()
        assert LLMConfig.from_hf(hf) == ours, family


@pytest.mark.parametrize("rope", [
    {"rope_theta": 5e5},  # transformers 4
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},  # transformers 5
    {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},  # 5's dict under the older name
    {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5} | {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}},
    # the same theta as an int and a float, and configs that carry both forms of the rope
    {"rope_theta": 500000, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    {"rope_theta": 500000, "rope_scaling": LLAMA3_SCALING, "rope_parameters": LLAMA3_SCALING | {"rope_theta": 5e5}},
    {"rope_theta": 5e5, "rope_scaling": {"type" if k == "rope_type" else k: v for k, v in LLAMA3_SCALING.items()},
     "rope_parameters": LLAMA3_SCALING},
    {"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
], ids=["top-level", "rope_parameters", "rope_scaling", "both-equal", "llama3-parameters", "int-and-float", "compat",
        "type-spelling", "empty-scaling"])
def test_rope_is_read_where_transformers_reads_it(rope):
    """rope_theta and the scaling from each place a config may hold them: the theta transformers
    builds the model with (a config that gave 5e5 only inside rope_scaling had been read as the
    default 1e4: logits far off, no error), and the scaling without the theta in it."""
    import transformers

    base = {k: v for k, v in small("llama").to_hf().items() if k not in ("rope_theta", "rope_scaling")}
    ours = LLMConfig.from_hf(copy.deepcopy(base | rope))
    hf = transformers.AutoConfig.for_model(**copy.deepcopy(base | rope))  # (it writes theta into the dicts)
    params = getattr(hf, "rope_parameters", None) or {}
    assert ours.rope_theta == params.get("rope_theta", getattr(hf, "rope_theta", None)) == 5e5
    llama3 = "llama3" in str(rope)
    assert ours.rope_scaling == (LLAMA3_SCALING if llama3 else None)
    torch.testing.assert_close(rope_inv_freq(ours), _hf_inv_freq(hf), rtol=1e-6, atol=0)


def _hf_inv_freq(hf_config) -> torch.Tensor:
    """transformers' rotary inverse frequencies for a config (its rope-init function)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = params.get("rope_type", "default")
    if kind == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        dim = hf_config.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")[0]


def test_swish_is_silu():
    cfg = small("qwen3").to_hf()
    assert LLMConfig.from_hf(cfg | {"hidden_act": "swish"}) == LLMConfig.from_hf(cfg)


def test_a_cache_of_another_dtype_is_refused():
    """A bfloat16 cache given to a float32 model is named (the appends would round every k and v
    to bfloat16 without a word), eagerly and when traced."""
    cfg = small("qwen3")
    model = DecoderLM(cfg, torch.float32, max_len=32).randomize(seed=random.randrange(1 << 30))
    kv = PagedKVCache(DecoderLM(cfg, torch.bfloat16, max_len=32), 1, 32, 16)
    kv.grow(1)
    message = r"kv_cache is torch.bfloat16; expected the model's dtype torch.float32"
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(torch.tensor([3]), *kv.args())
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    with pytest.raises(Exception, match=message), torch.no_grad():
        step(torch.tensor([3]), *kv.args())


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_one_sequence_restarts_while_the_others_decode_on(executor):
    """reset(b) empties slot b, its pages back to the free list, and leaves the other sequences
    alone: slot 1 then decodes a new prompt (on pages that held its old keys and values: page
    size 4) with the logits of a fresh batch-1 cache, slots 0 and 2 with those of an
    uninterrupted run — the compiled step (CPU interpreter, or the GPU kernel) against the
    float32 eager path, within 1e-5."""
    cfg = small("qwen3", head_dim=64)  # (the GPU's paged attention takes head dims 64, 128, 256)
    device = "cuda" if executor == "gpu" else "cpu"
    model = DecoderLM(cfg, torch.float32, device, max_len=32).randomize(seed=random.randrange(1 << 30))
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    toks, new = (torch.randint(0, cfg.vocab, shape, generator=g).to(device) for shape in ((3, 10), (5,)))
    kv, ref, solo = PagedKVCache(model, 3, 32, 4), PagedKVCache(model, 3, 32, 4), PagedKVCache(model, 1, 32, 4)
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": executor, "check_races": False})
    free = len(kv.free)
    with torch.no_grad():
        for i in range(10):
            if i == 5:
                kv.reset(1)
                assert kv.lens == [5, 0, 5] and len(kv.free) == free - 2 * 2
            kv.grow(1)
            ref.grow(1)
            t = toks[:, i].clone()
            if i >= 5:
                solo.grow(1)
                t[1] = new[i - 5]
            out, want = step(t, *kv.args()), model(toks[:, i], *ref.args())
            assert relative_error(out[[0, 2]], want[[0, 2]]) <= 1e-5
            other = want[1:2] if i < 5 else model(new[i - 5:i - 4], *solo.args())
            assert relative_error(out[1:2], other) <= 1e-5
    with pytest.raises(ValueError, match=r"reset\(\[0, 0\]\); expected a sequence index in \[0, 3\)"):
        kv.reset([0, 0])
    for bad in (3, True, "1", [1.0]):
        with pytest.raises(ValueError, match=re.escape(f"reset({bad!r})")):
            kv.reset(bad)
    kv.reset(np.flatnonzero([True, False, True]))  # NumPy indices, as a finished-sequence mask gives them
    assert kv.lens == [0, 10 - 5, 0]


def test_a_copy_of_the_cache_a_step_appends_to_is_refused():
    """A clone of the KV cache that the step's rope_append then updates in place is refused by
    name: the dependency analysis does not see the in-place append, so the copy's order
    against it would be the schedule's (one seed in three copied the appended token)."""
    model = DecoderLM(small("qwen3"), torch.float32, max_len=32).randomize(seed=random.randrange(1 << 30))
    kv = PagedKVCache(model, 1, 32, 16)
    kv.grow(1)

    class Snapshot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, tokens, cache, *table):
            snap = cache.clone()
            return self.m(tokens, cache, *table), snap

    step = torch.compile(Snapshot(), backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    with pytest.raises(Exception, match="a copy of a tensor the graph updates in place"), torch.no_grad():
        step(torch.tensor([3]), *kv.args())


def test_bad_page_size_and_lengths_are_named():
    model = DecoderLM(small("qwen3"), torch.float32)
    with pytest.raises(ValueError, match="page_size 3"):
        PagedKVCache(model, 1, 8, 3)
    short = DecoderLM(small("qwen3"), torch.float32, max_len=32)
    with pytest.raises(ValueError, match="max_len 64 exceeds the model's rope table of 32 positions"):
        PagedKVCache(short, 2, 64, 16)
    with pytest.raises(ValueError, match="batch 0"):
        PagedKVCache(short, 0, 32, 16)
    kv = PagedKVCache(short, 2, 32, 16)
    with pytest.raises(ValueError, match=r"grow\(\[1\]\); expected a count ≥ 0 \(an int\) or one per sequence \(2\)"):
        kv.grow([1])
    with pytest.raises(ValueError, match=r"grow\(-1\)"):
        kv.grow(-1)
    with pytest.raises(ValueError, match=r"grow\(1.5\)"):
        kv.grow(1.5)
    assert kv.lens == [0, 0]  # a refused grow changes nothing
    kv.grow(1)
    with pytest.raises(MpkError, match="sequence 1 would reach 101 tokens; max_len is 32"):
        kv.grow([1, 100])
    assert kv.lens == [1, 1] and kv.kv_indptr.tolist() == [0, 1, 2]  # nothing of it applied
    kv.grow([2, 0])
    assert kv.kv_last_page_len.tolist() == [3, 1] and kv.kv_indptr.tolist() == [0, 1, 2]
    kv.reset()
    assert kv.lens == [0, 0] and kv.kv_indptr.tolist() == [0, 0, 0] and kv.kv_last_page_len.tolist() == [0, 0]
    for bad, message in [(dict(max_len=0), "max_len=0; expected None"), (dict(num_splits=-1), "num_splits=-1"),
                         (dict(dtype=torch.int8), "dtype=torch.int8; expected torch.bfloat16"),
                         (dict(dtype=torch.float8_e4m3fn), "dtype=torch.float8_e4m3fn; expected torch.bfloat16"),
                         (dict(dtype=torch.float64), "dtype=torch.float64; expected torch.bfloat16")]:
        with pytest.raises(ValueError, match=message):
            DecoderLM(small("qwen3"), **{"dtype": torch.float32, **bad})


def test_tokens_must_match_the_page_table():
    """One token per sequence of the page table: a shorter batch would leave a counted sequence
    unwritten, so the step refuses it naming the shapes (eager, and when traced)."""
    model = DecoderLM(small("llama"), torch.float32, max_len=16).randomize()
    kv = PagedKVCache(model, 2, 16, 4)
    kv.grow(1)
    with pytest.raises(ValueError, match=r"tokens \(1,\), kv_indptr \(3,\), kv_last_page_len \(2,\); expected"):
        model(torch.tensor([5]), *kv.args())
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    with pytest.raises(Exception, match=r"expected \[B\], \[B \+ 1\] and \[B\]"):
        step(torch.tensor([5]), *kv.args())


def test_compiled_step_with_grad_enabled_says_to_use_no_grad():
    """A model compiled while autograd records (parameters that require grad) is refused with
    mpk's message — not AOTAutograd's internal error about mpk's custom ops (a decode step), nor
    a complaint about a layer norm's saved mean (a plain module) — and runs under no_grad."""
    model = DecoderLM(small("llama"), torch.float32, max_len=16).randomize()
    kv = PagedKVCache(model, 1, 16, 4)
    kv.grow(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))
    x = torch.randn(3, 8)
    message = r"mpk compiles inference graphs only: call the compiled model under torch.no_grad\(\)"
    for m, args in ((model, (torch.tensor([3]), *kv.args())), (mlp, (x,))):
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
        with pytest.raises(Exception, match=message):
            compiled(*args)
        with torch.no_grad():
            out, ref = compiled(*args), m(*args)
        assert relative_error(out, ref) <= 1e-5


def test_token_id_outside_the_vocabulary_is_named():
    """The compiled decode step (CPU interpreter) and the eager path refuse a token id outside
    the vocabulary with BadInputError naming the id, its sequence and the vocabulary size (the
    GPU executor raises the same: tests/gpu/test_gpu_decode.py)."""
    from mpk.errors import BadInputError

    cfg = small("qwen3")
    model = DecoderLM(cfg, torch.float32, max_len=16).randomize()
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    kv = PagedKVCache(model, 3, 16, 4)
    kv.grow(1)
    bad = random.choice([cfg.vocab, cfg.vocab + random.randrange(1000), -1])
    for run in (step, model):  # compiled, and the eager path alike
        with torch.no_grad(), pytest.raises(BadInputError, match=rf"token id {bad} at row 1 is outside the "
                                                                 rf"embedding table's {cfg.vocab} rows \[0, {cfg.vocab}\)"):
            run(torch.tensor([0, bad, 5]), *kv.args())


# tiles that split query heads off their groups (rope_append [1, 3, 1] over 4 heads in groups
# of 2: the middle tile appends no kv head) and several rows / chunks per tile
ODD_TILES = {"rope_append": [1, 3, 1], "attn_partial": [2, 1, 1, 1, 1], "attn_merge": [2, 3, 1],
             **{name: [2, 3] for name in ("matmul_silu_mul_default", "matmul_silu_mul_default_1")}}
# the fused rope + attention with several rows and chunks per tile (the appending last chunk
# shares its tile with another chunk, and both kv heads share one)
ODD_FUSED = {"rope_attn_partial": [2, 1, 1, 1, 1], "attn_merge": [2, 3, 1]}


@pytest.mark.parametrize("family,page_size,prologue,partition,fuse_rope,splits", [
    ("llama", 4, False, {}, True, 2), ("qwen3", 1, True, {}, True, 3), ("qwen3", 16, False, {}, False, 2),
    ("qwen3", 4, False, ODD_TILES, False, 2), ("qwen3", 4, False, ODD_FUSED, True, 2),
    ("llama", 2, False, ODD_FUSED, True, 3),
    # one chunk per sequence (the default for this short cache): the attention tasks write the
    # output and there is no merge op (two rows per tile)
    ("qwen3", 4, False, {"rope_attn_partial": [2, 1, 1, 1]}, True, 1), ("llama", 16, True, {}, False, 0)])
def test_compiled_decode_matches_eager(family, page_size, prologue, partition, fuse_rope, splits):
    """The whole decode step through torch.compile(backend='mpk') on the CPU interpreter:
    batch 3 of different lengths, several steps, fp32 within 1e-5 of the eager path; the
    cache written by the compiled step equals the eager one. With rope fused into attention
    and without, with KV chunks merged by ⊕ and with one chunk written directly."""
    cfg = small(family)
    model = DecoderLM(cfg, torch.float32, num_splits=splits).randomize(seed=random.randrange(1 << 30))
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", "seed": random.randrange(100), "fuse_norm_prologue": prologue,
                                  "partition": partition, "fuse_rope_attention": fuse_rope})
    eager_kv, mpk_kv = PagedKVCache(model, 3, 32, page_size), PagedKVCache(model, 3, 32, page_size)
    tokens = torch.randint(0, cfg.vocab, (3,))
    with torch.no_grad():
        for t in range(4):
            grow = [1, 6, 11] if t == 0 else 1
            eager_kv.grow(grow)
            mpk_kv.grow(grow)
            ref = model(tokens, *eager_kv.args())
            out = step(tokens, *mpk_kv.args())
            assert relative_error(out, ref) <= 1e-5
            assert relative_error(mpk_kv.cache, eager_kv.cache) <= 1e-6
            tokens = ref.argmax(-1)
    kinds = op_forms(COMPILED[-1].graph)
    assert kinds.count("attn_merge") == (0 if splits <= 1 else cfg.layers)
    if fuse_rope:
        assert kinds.count("rope_attn_partial") == cfg.layers
        assert "rope_append" not in kinds and "attn_partial" not in kinds
    else:
        assert kinds.count("rope_append") == kinds.count("attn_partial") == cfg.layers
    # o and down take the residual in their epilogue, gate_up SiLU·mul in its epilogue; with
    # the prologue option, qkv and the head take their RMSNorm as a prologue
    assert "silu_mul" not in kinds
    if prologue:  # every RMSNorm runs inside the projection after it (gate·up: with its SiLU·mul)
        assert kinds.count("matmul") == 2 * cfg.layers and kinds.count("rms_norm_matmul") == cfg.layers + 1
        assert kinds.count("rms_norm_matmul_silu_mul") == cfg.layers
        assert "rms_norm" not in kinds and "matmul_silu_mul" not in kinds
    else:
        assert kinds.count("matmul") == 3 * cfg.layers + 1 and not any(k.startswith("rms_norm_matmul") for k in kinds)
        assert kinds.count("matmul_silu_mul") == cfg.layers


@pytest.mark.parametrize("family,fuse_rope", [("llama", True), ("qwen3", False)])
def test_arguments_that_start_inside_their_storage(family, fuse_rope):
    """Graph inputs that are views into a larger storage (a row of a token matrix, a cache
    sliced from a bigger tensor) are read and written at their own offset: the CPU
    interpreter once took view offsets from the storage's start, so a teacher-forced row
    tokens[t] decoded tokens[0] and the cache's appends landed before the slice."""
    cfg = small(family)
    model = DecoderLM(cfg, torch.float32).randomize(seed=random.randrange(1 << 30))
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", "fuse_rope_attention": fuse_rope})
    check_arguments_inside_storage(model, step, 3, 4, 4)


@pytest.mark.parametrize("family,batch,hidden,options", [
    ("llama", 1, 256, {"fuse_norm_stats": True}), ("qwen3", 3, 256, {"fuse_norm_stats": True}),
    # uneven tiles of 16-column groups, rows split over tiles, the consumer over rows and columns
    ("qwen3", 4, 256, {"fuse_norm_stats": True,
                       "partition": {**{f"matmul_norm_stats_default{s}": [1, 2, 3, 1] for s in ("", "_1", "_2", "_3")},
                                     **{f"norm_stats_matmul_default{s}": [2, 3] for s in ("", "_1", "_2", "_3")}}}),
    # 12 workers: 8-column groups (tiles of 16 and 24 columns, where 16-column groups gave 16 and 32)
    ("llama", 2, 256, {"fuse_norm_stats": True, "num_workers": 12}),
    # "auto" (the default) splits the norms of more than 4 KiB of x (3 × 1024 bf16: 6 KiB,
    # which the prologue's 8 KiB tile would hold; 5 × 1024: 10 KiB, which it would not) and
    # leaves smaller ones to the prologue, unless that is off
    ("llama", 1, 256, {}), ("qwen3", 3, 1024, {}), ("qwen3", 5, 1024, {}),
    ("llama", 1, 256, {"fuse_norm_prologue": False}), ("qwen3", 3, 1024, {"fuse_norm_stats": False})])
def test_norm_split_between_projections_in_a_decode_step(family, batch, hidden, options):
    """fuse_norm_stats on a bf16 decode step (CPU interpreter): an RMSNorm after a residual
    projection is split between that projection (matmul_norm_stats: a norm_stats epilogue) and
    the one after it (norm_stats_matmul: a norm_stats prologue) — every one with True (only the first layer's input norm, after the
    embedding, stays), by default ("auto") those of more than 4 KiB of x. Over 4 steps the
    logits are as close to a float32 twin's (same weights and tokens) as mpk's eager bf16
    path's are — largest and median relative error within 1.5× of the eager path's (the split
    rounds differently, by about a bf16 ulp of the normalised activation; 200 teacher-forced
    draws of the llama batch-1 case without the prologue measured ≤ 1.38×, where feeding back
    the arg-max had let batch 1 repeat one token, its 4 steps one draw, 1.62× once in 200),
    where a fixed 2e-2 against the eager path failed one draw in eight — with top-1 agreement
    ≥ 99% with the eager path where its logits are decisive; the cache written by layer 0 is
    equal."""
    cfg = small(family, hidden=hidden, inter=2 * hidden, head_dim=64)
    model = DecoderLM(cfg, torch.bfloat16).randomize(seed=random.randrange(1 << 30))
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", "num_workers": 16, **options})
    eager_kv, mpk_kv, _ = against_eager_and_float32(model, step, batch, 32, 4, 4, [1 + 4 * b for b in range(batch)])
    assert torch.equal(mpk_kv.cache[0], eager_kv.cache[0])
    graph = COMPILED[-1].graph
    kinds = [k.removesuffix("_silu_mul") for k in op_forms(graph)]  # the prologues, with SiLU·mul or not
    prologue, split = norm_fusions(options, batch, hidden)
    assert kinds.count("matmul_norm_stats") == kinds.count("norm_stats_matmul") == (2 * cfg.layers if split else 0)
    groups = {graph.buffers[op.output].shape[-1] for op, k in zip(graph.ops, kinds) if k == "matmul_norm_stats"}
    assert groups <= ({8} if options.get("num_workers") == 12 else {16})
    norm = "rms_norm_matmul" if prologue else "rms_norm"
    assert kinds.count(norm) == (1 if split else 2 * cfg.layers + 1)
    assert "rms_norm" not in kinds or "rms_norm_matmul" not in kinds


@pytest.mark.parametrize("family,batch,options", [("llama", 1, {}), ("qwen3", 5, {}),
                                                  ("qwen3", 2, {"fuse_norm_stats": True, "num_workers": 12})])
def test_inspection_compiles_the_graph_the_backend_runs(family, batch, options):
    """compile_module (``mpk inspect``) traces as ``torch.compile(backend="mpk")`` does: a decode
    step's op graph and tables are the backend's byte for byte, fused ops included (it had
    traced with torch.export, whose graph keeps F.linear whole: no RMSNorm fused into a
    projection, SiLU·mul a stage of its own, so it showed 21 ops for a 2-layer llama3.2-1b
    step that runs 12), with the model's own parameter names."""
    from mpk.inspection import compile_module

    cfg = small(family, hidden=1024, inter=2048, head_dim=64)
    model = DecoderLM(cfg, torch.bfloat16).randomize(seed=random.randrange(1 << 30))
    cache = PagedKVCache(model, batch, 64, 16)
    cache.grow([1 + 3 * b for b in range(batch)])
    args = (torch.randint(0, cfg.vocab, (batch,)), *cache.args())
    mine = compile_module(model, args, options)
    with torch.no_grad():
        torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu", **options})(*args)
    ran = COMPILED[-1]
    assert mine.graph.describe() == ran.graph.describe()
    assert mine.tables.to_bytes() == ran.tables.to_bytes()
    kinds = [k.removesuffix("_silu_mul") for k in op_forms(mine.graph)]  # the prologues, with SiLU·mul or not
    prologue, split = norm_fusions(options, batch, cfg.hidden)
    norm = "rms_norm_matmul" if prologue else "rms_norm"
    assert kinds.count(norm) == (1 if split else 2 * cfg.layers + 1)
    assert kinds.count("norm_stats_matmul") == (2 * cfg.layers if split else 0) and "silu_mul" not in kinds
    assert "layers.1.gate_up" in mine.graph.describe()


@pytest.mark.parametrize("batch", [1, 4])
def test_o_projection_avoids_the_workers_of_a_narrow_attention(batch):
    """With 16 workers, attention over 2 kv heads at batch 4 is 8 tasks (narrow: 4–8), so the
    o projection after it takes the 8 workers attention leaves free (8 tiles, not 16): placed
    round-robin in linear order, as both executors place AOT tasks, none of its tasks shares a
    worker with attention, for any worker count from 16 up. At batch 1 (2 attention tasks)
    the o projection keeps its default tiles. Either way the step matches the eager path."""
    from mpk.compiler.tables import FLAG_JIT

    cfg = small("llama")
    model = DecoderLM(cfg, torch.float32).randomize(seed=random.randrange(1 << 30))
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", "num_workers": 16, "fuse_norm_prologue": False})
    eager_kv, mpk_kv = PagedKVCache(model, batch, 16, 4), PagedKVCache(model, batch, 16, 4)
    tokens = torch.randint(0, cfg.vocab, (batch,))
    with torch.no_grad():
        eager_kv.grow(5)
        mpk_kv.grow(5)
        assert relative_error(step(tokens, *mpk_kv.args()), model(tokens, *eager_kv.args())) <= 1e-5
    compiled = COMPILED[-1]
    ops, t = compiled.graph.ops, compiled.tables
    attention = [op.id for op in ops if op.kind == "rope_attn_partial"]
    forms = op_forms(compiled.graph)
    assert attention and all(forms[a + 1] == "matmul" for a in attention)  # the o projection
    aot = [i for i in range(len(t.tasks)) if not t.tasks["flags"][i] & FLAG_JIT]  # task ids are in linear order
    op_of = t.tasks["op"]
    for a in attention:
        n_att = int((op_of == a).sum())
        n_o = int((op_of == a + 1).sum())
        assert n_att == batch * cfg.kv_heads
        assert n_o == (16 - n_att if batch == 4 else batch * cfg.hidden // 16)  # else: tiles of 16 (min_tile_elems)
        if batch == 4:
            for workers in (16, 17, 20):
                place = {task: pos % workers for pos, task in enumerate(aot)}
                on = lambda op: {place[i] for i in range(len(op_of)) if op_of[i] == op}  # noqa: E731
                assert not on(a) & on(a + 1), workers


def _decode_example():
    """examples/decode.py as a module (its main takes argv)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_example_runs_a_hf_checkpoint(tmp_path, capsys):
    """examples/decode.py on a transformers-written checkpoint: greedy ids come out, the
    compiled steps match mpk's eager path, and generation stops at the checkpoint's
    end-of-sequence id."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**small("qwen3").to_hf()))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    module = _decode_example()
    assert module.main(["--model", str(tmp_path), "--prompt-ids", "5", "9", "--steps", "3", "--executor", "cpu",
                        "--page-size", "2", "--check"]) == 0
    out = capsys.readouterr().out
    ids = ast.literal_eval(out.split("generated ids: ")[1].splitlines()[0])
    assert len(ids) == 3 and all(0 <= i < 97 for i in ids)
    assert float(out.split("max |logit|: ")[1].split()[0]) <= 1e-5
    # token ids stop at an end-of-sequence id generation_config.json names, as text does
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[0]}))
    assert module.main(["--model", str(tmp_path), "--prompt-ids", "5", "9", "--steps", "3", "--executor", "cpu",
                        "--page-size", "2"]) == 0
    assert ast.literal_eval(capsys.readouterr().out.split("generated ids: ")[1].splitlines()[0]) == ids[:1]
    # text needs the checkpoint's tokenizer, which this one lacks: named, no traceback
    with pytest.raises(SystemExit) as info:
        module.main(["--model", str(tmp_path), "--prompt", "hello", "--executor", "cpu"])
    assert info.value.code == 2
    assert f"--prompt: {tmp_path} holds no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model, " \
        "vocab.json, vocab.txt, spiece.model); pass token ids with --prompt-ids instead" in capsys.readouterr().err


def test_decode_example_takes_text_through_the_checkpoint_tokenizer(tmp_path, capsys):
    """--prompt: the checkpoint's own tokenizer (a word-level one saved beside the weights) turns
    the text into the prompt ids, the completion comes back as text, and decoding stops at the
    tokenizer's end-of-sequence token."""
    import tokenizers
    import transformers

    words = [f"w{i}" for i in range(small("llama").vocab - 2)]  # every id the model can generate is a token
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    inner.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="</s>")
    cfg = small("llama")
    # the checkpoint's generation_config.json names the tokenizer's end-of-sequence id (Llama's
    # default, 2, is a word here: a draw that generated it stopped there, as it should)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg.to_hf(), eos_token_id=vocab["</s>"]))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    module = _decode_example()
    prompt = " ".join(random.sample(words, 3))
    capsys.readouterr()
    assert module.main(["--model", str(tmp_path), "--prompt", prompt, "--steps", "6", "--executor", "cpu"]) == 0
    out, err = capsys.readouterr()
    ids = ast.literal_eval(out.split("generated ids: ")[1].splitlines()[0])
    text = out.split("text: ")[1].splitlines()[0]
    assert 1 <= len(ids) <= 6 and (len(ids) == 6 or ids[-1] == tok.eos_token_id)
    assert tok.eos_token_id not in ids[:-1]  # it stopped at the first one
    assert text == tok.decode([vocab[w] for w in prompt.split()] + ids, skip_special_tokens=True)
    assert text.startswith(prompt)
    assert tok.decode(ids, skip_special_tokens=True) in err  # streamed as it was generated
    # the same prompt with the first generated token as end-of-sequence: one token, then stop
    first = {i: w for w, i in vocab.items()}[ids[0]]
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token=first).save_pretrained(tmp_path)
    assert module.main(["--model", str(tmp_path), "--prompt", prompt, "--steps", "6", "--executor", "cpu"]) == 0
    assert ast.literal_eval(capsys.readouterr().out.split("generated ids: ")[1].splitlines()[0]) == ids[:1]
    with pytest.raises(SystemExit):  # text without a checkpoint's tokenizer
        module.main(["--random", "llama-tiny", "--prompt", prompt, "--executor", "cpu"])


def test_decode_example_stops_at_every_eos_id_the_checkpoint_names(tmp_path):
    """Generation ends at the tokenizer's end-of-sequence id and at those generation_config.json
    lists (one id or several, as Llama 3 instruct checkpoints do): mpk.engine.loading.eos_ids,
    which the example and mpk.LLM use."""
    from mpk.engine import loading as module
    assert module.eos_ids(str(tmp_path), 1) == {1}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert module.eos_ids(str(tmp_path), 1) == {1, 7, 9}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert module.eos_ids(str(tmp_path), None) == {7}
    # a file it cannot read as ids is named (a string id would otherwise never stop generation)
    for text, message in (("{oops", "is not valid JSON"), ("[1, 2]", "expected a JSON object whose eos_token_id"),
                          ('{"eos_token_id": "2"}', "eos_token_id is a token id or a list of them; got '2'")):
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(MpkError, match=re.escape(message)):
            module.eos_ids(str(tmp_path), None)


def test_attention_must_read_the_appended_q():
    """The cache append is invisible to the dependency analysis; attention that does not read
    the q of its layer's rope_append (so nothing orders it after the append) is refused."""
    cfg = small("qwen3")
    model = DecoderLM(cfg, torch.float32).randomize()
    layer = model.layers[0]

    def step(x, cache, indptr, indices, last):
        qkv = torch.nn.functional.linear(x, layer.qkv)
        q = torch.ops.mpk.rope_append(qkv, model.cos_sin, indptr, indices, last, cache, layer.q_norm,
                                      layer.k_norm, 0, cfg.heads, cfg.kv_heads, cfg.eps)
        unrotated = qkv[:, : cfg.heads * cfg.head_dim].reshape(x.shape[0], cfg.heads, cfg.head_dim) * 1.0
        return q, torch.ops.mpk.paged_attention(unrotated, cache, indptr, indices, last, 0, 0.25, 1)

    kv = PagedKVCache(model, 2, 16, 4)
    kv.grow(3)
    compiled = torch.compile(step, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    with pytest.raises(Exception, match="must read the q returned"):
        with torch.no_grad():
            compiled(torch.randn(2, cfg.hidden), *kv.args())


def test_rope_stays_apart_when_attention_reads_other_tables():
    """rope_append runs inside the attention tasks only when both read the same cache and page
    tables; here the attention gets its own copy of the page table, so the two stay separate
    ops, and the step still matches eager (cache included)."""
    cfg = small("qwen3")
    model = DecoderLM(cfg, torch.float32).randomize(seed=random.randrange(1 << 30))
    layer = model.layers[0]

    def step(x, cache, indptr, indices, last, indptr2, indices2, last2):
        qkv = torch.nn.functional.linear(x, layer.qkv)
        q = torch.ops.mpk.rope_append(qkv, model.cos_sin, indptr, indices, last, cache, layer.q_norm,
                                      layer.k_norm, 0, cfg.heads, cfg.kv_heads, cfg.eps)
        return torch.ops.mpk.paged_attention(q, cache, indptr2, indices2, last2, 0, cfg.head_dim ** -0.5, 2)

    kv_e, kv_m = PagedKVCache(model, 2, 16, 4), PagedKVCache(model, 2, 16, 4)
    for kv in (kv_e, kv_m):
        kv.grow([3, 6])
        kv.cache.normal_(generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, cfg.hidden)
    compiled = torch.compile(step, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "cpu"})
    with torch.no_grad():
        tables_e, tables_m = kv_e.args()[1:], kv_m.args()[1:]
        ref = step(x, kv_e.cache, *tables_e, *[t.clone() for t in tables_e])
        out = compiled(x, kv_m.cache, *tables_m, *[t.clone() for t in tables_m])
    assert relative_error(out, ref) <= 1e-5 and relative_error(kv_m.cache, kv_e.cache) <= 1e-6
    kinds = [op.kind for op in COMPILED[-1].graph.ops]
    assert "rope_append" in kinds and "attn_partial" in kinds and "rope_attn_partial" not in kinds


def test_paged_ops_refuse_bad_page_tables():
    """The paged ops name what the tasks cannot follow: a page size that is not a power of two,
    table tensors of the wrong shape, heads that do not group, and (where the table is read, eager
    and on the CPU interpreter) entries outside the cache or the page (which the GPU tasks check
    as they read them: tests/gpu/test_gpu_decode.py)."""
    from mpk.errors import BadInputError

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    ps, pages = 4, 6
    q, scale = torch.randn(2, 4, 64, generator=g), 0.125
    cache = torch.randn(1, 2, pages, 2, ps, 64, generator=g)
    indptr, indices, last = torch.tensor([0, 2, 5], dtype=torch.int32), torch.randperm(pages, generator=g).int(), \
        torch.tensor([3, 2], dtype=torch.int32)
    assert paged_attention(q, cache, indptr, indices, last, 0, scale, 1).isfinite().all()
    with pytest.raises(ValueError, match="page_size 3; expected a power of two"):
        paged_attention(q, torch.randn(1, 2, pages, 2, 3, 64), indptr, indices, last, 0, scale, 1)
    with pytest.raises(ValueError, match=r"kv_indptr has shape \(2,\); expected \(3,\) for a batch of 2"):
        paged_attention(q, cache, indptr[:2], indices, last, 0, scale, 1)
    with pytest.raises(ValueError, match="layer 1; the cache has layers 0…0"):
        paged_attention(q, cache, indptr, indices, last, 1, scale, 1)
    with pytest.raises(ValueError, match="the cache has 0 pages; expected at least one"):
        paged_attention(q, cache[:, :, :0], indptr, indices, last, 0, scale, 1)
    with pytest.raises(ValueError, match="num_splits -1"):
        paged_attention(q, cache, indptr, indices, last, 0, scale, -1)
    for bad, message in [((indptr, indices, torch.tensor([5, 2], dtype=torch.int32)),
                          r"kv_last_page_len\[0\] = 5; expected 1…4"),
                         ((indptr, torch.tensor([0, 1, -1, 3, 4, 5], dtype=torch.int32), last),
                          r"kv_indices\[2\] = -1 \(a page of sequence 1\) is outside the cache's 6 pages"),
                         ((torch.tensor([0, 3, 2], dtype=torch.int32), indices, last),
                          r"kv_indptr decreases at sequence 1 \(3 → 2\)"),
                         ((torch.tensor([0, 2, 7], dtype=torch.int32), indices, last),
                          r"kv_indptr spans entries 0…7 of kv_indices, which has 6")]:
        with pytest.raises(BadInputError, match=message):
            paged_attention(q, cache, *bad, 0, scale, 1)
    qkv = torch.randn(2, (6 + 2 * 4) * 64, generator=g)
    with pytest.raises(ValueError, match="heads 6, kv_heads 4; expected kv_heads = the cache's 2"):
        torch.ops.mpk.rope_append(qkv, torch.randn(16, 64), indptr, indices, last, cache, None, None, 0, 6, 4, 1e-6)
    qkv = torch.randn(2, (4 + 2 * 2) * 64, generator=g)
    # worded as the GPU executor reports it (mpk.errors.BAD_INPUTS)
    with pytest.raises(BadInputError, match=r"rope_append: decode position \(the sequence's length − 1\) -1 at row 0 "
                                            r"is outside the rope table's 16 positions \[0, 16\)"):
        torch.ops.mpk.rope_append(qkv, torch.randn(16, 64), torch.tensor([0, 0, 3], dtype=torch.int32), indices, last,
                                  cache, None, None, 0, 4, 2, 1e-6)  # sequence 0 not grown: no pages


def test_decode_example_refuses_what_it_cannot_run(tmp_path, capsys, monkeypatch):
    """No CUDA for --executor gpu, a --model that is not a checkpoint, a checkpoint mpk refuses:
    each a one-line message naming the problem, no traceback."""
    module = _decode_example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--random", "qwen3-tiny", "--executor", "gpu"], "this machine has no CUDA device"),
                          (["--model", str(tmp_path / "none"), "--executor", "cpu"],
                           "expected a checkpoint directory holding config.json")):
        with pytest.raises(SystemExit) as info:
            module.main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(small("qwen3").to_hf() | {"hidden_act": "gelu"}))
    with pytest.raises(SystemExit) as info:
        module.main(["--model", str(tmp_path), "--executor", "cpu"])
    assert str(info.value).startswith("ConfigError: ") and "hidden_act 'gelu' is not supported" in str(info.value)
