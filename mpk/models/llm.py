"""Llama and Qwen3 decoders built from a Hugging Face ``config.json``, written to be traced.

``DecoderLM.forward`` is ONE decode step: a token per sequence in, logits out, with the paged
KV cache (``mpk.ops.paged`` documents its layout) and its page table passed as tensors, so
``torch.compile(model, backend="mpk", fullgraph=True)`` traces the whole step into one graph
with static shapes. Projections are fused the way fast engines store them (q|k|v and
gate|up as one weight each); ``load_pretrained`` does the fusing from HF safetensors names.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.errors import BAD_TOKEN, BadInputError, ConfigError, MpkError, bad_input_message
from mpk.ops.paged import PAGE_SIZES, is_page_size

FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# What transformers' LlamaConfig / Qwen3Config take for a field the config.json leaves out
# (num_key_value_heads null means "as many as the query heads" in both; Llama's head_dim
# defaults to hidden_size / heads).
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32,
              "sliding_window": 4096, "max_window_layers": 28},
}


def _sliding_layers(config: dict[str, Any]) -> list[int]:
    """The layers a HF config gives sliding-window attention: ``layer_types``, else Qwen3's
    ``use_sliding_window`` from layer ``max_window_layers`` on, as transformers derives them
    (Llama has no sliding window)."""
    types = config.get("layer_types")
    if types is None:
        if config.get("model_type") != "qwen3":
            return []
        layers = config["num_hidden_layers"]
        on = config.get("use_sliding_window") and config["sliding_window"] is not None
        first = config["max_window_layers"]
        types = ["sliding_attention" if on and i >= first else "full_attention" for i in range(layers)]
    return [i for i, t in enumerate(types) if t != "full_attention"]


def _positive(where: str, config: dict[str, Any], key: str, kind: type = int) -> Any:
    """config[key] as a positive int (or float), else a ConfigError naming it."""
    v = config[key]
    ok = (isinstance(v, int) and not isinstance(v, bool)) if kind is int else \
        (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    if not ok or v <= 0:
        raise ConfigError(f"{where}: {key} {v!r}; expected a positive {'integer' if kind is int else 'number'}")
    return kind(v)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_settings(where: str, config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling dict or None) of a HF config. transformers ≥ 5 writes the rope
    as one ``rope_parameters`` dict (theta inside) and reads ``rope_scaling`` as another name for
    it; older configs have a top-level ``rope_theta`` and ``rope_scaling`` without it, and some
    carry both forms. Sources that agree (500000 and 500000.0, ``type`` for ``rope_type``, an
    empty dict for none) are one setting; where they disagree transformers picks one by its
    version's rules, so a ConfigError names both rather than this decoder guessing."""
    given: dict[str, dict[str, Any]] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is None or value == {}:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} {value!r}; expected a JSON object such as "
                              '{"rope_type": "llama3", "factor": 8.0, ...}')
        given[key] = value
    thetas: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {}  # each dict without its theta, "type" read as "rope_type"
    for key, value in given.items():
        rest = dict(value)
        if "rope_theta" in rest:
            thetas[f"{key}.rope_theta"] = rest.pop("rope_theta")
        if "type" in rest and "rope_type" not in rest:
            rest["rope_type"] = rest.pop("type")
        settings[key] = rest
    if len(settings) == 2 and settings["rope_parameters"] != settings["rope_scaling"]:
        raise ConfigError(f"{where}: rope_parameters {given['rope_parameters']} and rope_scaling "
                          f"{given['rope_scaling']} differ; expected one of them (transformers reads both as the "
                          "rope's settings)")
    if config.get("rope_theta") is not None:
        thetas["rope_theta"] = config["rope_theta"]
    for name, value in thetas.items():
        _positive(where, {name: value}, name, float)
    if len({float(v) for v in thetas.values()}) > 1:
        raise ConfigError(f"{where}: " + " and ".join(f"{k} {v!r}" for k, v in thetas.items()) +
                          " differ; expected one rope_theta")
    theta = float(next(iter(thetas.values()), 10000.0))
    source, rope = next(iter(settings.items()), ("rope_scaling", {}))
    kind = rope.get("rope_type", "default")
    if kind == "llama3":
        for key in _LLAMA3_KEYS:
            if key in rope:
                _positive(f"{where}: {source}", rope, key, int if key.startswith("original") else float)
        if all(k in rope for k in _LLAMA3_KEYS[1:3]) and rope["high_freq_factor"] <= rope["low_freq_factor"]:
            raise ConfigError(f"{where}: {source} high_freq_factor {rope['high_freq_factor']} is not above "
                              f"low_freq_factor {rope['low_freq_factor']}; Llama 3 scaling interpolates between them")
    return theta, (rope if kind != "default" else None)


@dataclass(frozen=True)
class LLMConfig:
    """The fields of a HF config that a decode step needs."""

    family: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position: int = 4096

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> "LLMConfig":
        """From a config dict, a ``config.json`` path, or a checkpoint directory holding one.

        Raises ``ConfigError`` naming the field for a config this decoder would not compute
        faithfully: another model type, projection biases, an activation other than SiLU,
        sliding-window layers, quantized weights, rope scaling other than Llama 3's, head
        counts that do not divide, or a missing required field."""
        where = "config"
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            where = str(path)
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not valid JSON: {e}") from None
            except OSError as e:
                raise ConfigError(f"{where} cannot be read ({e.strerror}); expected a Hugging Face config.json "
                                  "(or a checkpoint directory holding one)") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{where} holds a {type(config).__name__}; expected a JSON object")
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not supported; "
                              f"expected one of {sorted(FAMILIES)}")
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ConfigError(f"{where} lacks {', '.join(missing)}; a {model_type} decoder needs "
                              f"{', '.join(_REQUIRED)}")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ConfigError(f"{where}: projection biases (attention_bias / mlp_bias) are not supported")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' two names of x·sigmoid(x)
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported; expected 'silu' (or 'swish')")
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ConfigError(f"{where}: tie_word_embeddings {tied!r}; expected true or false")
        quant = config.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ConfigError(f"{where}: quantized checkpoints (quant_method {method!r}) are not supported; "
                              "expected bf16, f16 or f32 weights")
        config = _DEFAULTS[model_type] | config
        for key in _REQUIRED:
            _positive(where, config, key)
        sliding = _sliding_layers(config)
        if sliding:
            raise ConfigError(f"{where}: layers {_few([str(i) for i in sliding])} use sliding-window attention, "
                              "which is not supported; expected full attention in every layer")
        heads = config["num_attention_heads"]
        # null: as many kv heads as query heads, head_dim = hidden_size / heads (as transformers reads it)
        kv_heads = heads if config.get("num_key_value_heads") is None else _positive(where, config, "num_key_value_heads")
        if heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
        if config.get("head_dim") is not None:
            head_dim = _positive(where, config, "head_dim")
        elif config["hidden_size"] % heads:
            raise ConfigError(f"{where}: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads "
                              f"{heads}, and there is no head_dim")
        else:
            head_dim = config["hidden_size"] // heads
        if head_dim % 2:
            raise ConfigError(f"{where}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of dims")
        eps = _positive(where, config, "rms_norm_eps", float)
        max_position = _positive(where, config, "max_position_embeddings")
        theta, scaling = _rope_settings(where, config)
        cfg = cls(family=model_type, hidden=config["hidden_size"], inter=config["intermediate_size"],
                  layers=config["num_hidden_layers"], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  vocab=config["vocab_size"], tied=tied, eps=eps, rope_theta=theta, rope_scaling=scaling,
                  max_position=max_position)
        try:
            rope_inv_freq(cfg)  # the rope scaling is one this decoder computes
        except (MpkError, KeyError) as e:
            raise ConfigError(f"{where}: {e if isinstance(e, MpkError) else f'rope_scaling lacks {e}'}") from None
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """A HF config dict describing this model (tests build transformers models from it)."""
        cfg = dict(model_type=self.family, architectures=[FAMILIES[self.family]], hidden_size=self.hidden,
                   intermediate_size=self.inter, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                   num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                   tie_word_embeddings=self.tied, rms_norm_eps=self.eps, rope_theta=self.rope_theta,
                   max_position_embeddings=self.max_position, hidden_act="silu", attention_bias=False,
                   torch_dtype="bfloat16")
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# Public model shapes (random-weight benchmarks, inspection, tests): first those of
# shared/BENCHMARKS.md, then other public checkpoints' as their config.json gives them, which
# the GPU tests run cut to two layers (head groups of 1-8 query heads, head dims 64 and 128,
# hidden sizes that are not multiples of 256, Llama 3.1's rope scaling).
SHAPES: dict[str, LLMConfig] = {
    "llama3.2-1b": LLMConfig("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 1e-5, 5e5, _LLAMA3_SCALING, 131072),
    "qwen3-0.6b": LLMConfig("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e-6, 1e6, None, 40960),
    "qwen3-1.7b": LLMConfig("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True, 1e-6, 1e6, None, 40960),
    "qwen3-8b": LLMConfig("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, 1e-6, 1e6, None, 40960),
    "llama3.2-3b": LLMConfig("llama", 3072, 8192, 28, 24, 8, 128, 128256, True, 1e-5, 5e5, _LLAMA3_SCALING, 131072),
    "llama3.1-8b": LLMConfig("llama", 4096, 14336, 32, 32, 8, 128, 128256, False, 1e-5, 5e5,
                             _LLAMA3_SCALING | {"factor": 8.0}, 131072),
    "llama2-7b": LLMConfig("llama", 4096, 11008, 32, 32, 32, 128, 32000, False, 1e-5, 1e4, None, 4096),
    "tinyllama-1.1b": LLMConfig("llama", 2048, 5632, 22, 32, 4, 64, 32000, False, 1e-5, 1e4, None, 2048),
    "smollm2-135m": LLMConfig("llama", 576, 1536, 30, 9, 3, 64, 49152, True, 1e-5, 1e5, None, 8192),
    "smollm2-360m": LLMConfig("llama", 960, 2560, 32, 15, 5, 64, 49152, True, 1e-5, 1e5, None, 8192),
    "qwen3-4b": LLMConfig("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True, 1e-6, 1e6, None, 40960),
    "qwen3-14b": LLMConfig("qwen3", 5120, 17408, 40, 40, 8, 128, 151936, False, 1e-6, 1e6, None, 40960),
    "qwen3-32b": LLMConfig("qwen3", 5120, 25600, 64, 64, 8, 128, 151936, False, 1e-6, 1e6, None, 40960),
}


def rope_inv_freq(cfg: LLMConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 scaling when the config asks for it."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise MpkError(f"rope_scaling type {kind!r} is not supported; expected 'llama3' or none")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(is_mid, mid, scaled)


def rope_table(cfg: LLMConfig, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_len, head_dim]: cos of each position in the first half, sin in the second, rounded
    to the model dtype as HF rounds them."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg))
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int, dtype: torch.dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg, self.index = cfg, index
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, cfg.hidden, **kw))
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.o = nn.Parameter(torch.empty(cfg.hidden, q, **kw))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.inter, cfg.hidden, **kw))
        self.down = nn.Parameter(torch.empty(cfg.hidden, cfg.inter, **kw))

    def forward(self, x, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, num_splits: int):
        c = self.cfg
        h = torch.ops.mpk.rms_norm(x, self.input_norm, c.eps, torch.float32, x.dtype)
        qkv = torch.nn.functional.linear(h, self.qkv)
        q = torch.ops.mpk.rope_append(qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache,
                                      self.q_norm, self.k_norm, self.index, c.heads, c.kv_heads, c.eps)
        a = torch.ops.mpk.paged_attention(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, self.index,
                                          c.head_dim ** -0.5, num_splits)
        x = x + torch.nn.functional.linear(a.reshape(x.shape[0], -1), self.o)
        h = torch.ops.mpk.rms_norm(x, self.post_norm, c.eps, torch.float32, x.dtype)
        gu = torch.nn.functional.linear(h, self.gate_up)
        return x + torch.nn.functional.linear(torch.ops.mpk.silu_mul(gu[:, : c.inter], gu[:, c.inter:]), self.down)


class DecoderLM(nn.Module):
    """A Llama/Qwen3 causal LM whose forward is one decode step over a paged KV cache.

    ``forward(tokens [B] int64, kv_cache, kv_indptr [B+1] int32, kv_indices [N] int32,
    kv_last_page_len [B] int32) -> logits [B, vocab]``; the page table must already count the
    token being decoded (``PagedKVCache.grow`` does that). ``num_splits``: KV chunks per
    sequence for attention, at most (a sequence uses one per 128 positions; 0: the compiler
    picks).
    """

    def __init__(self, cfg: LLMConfig, dtype: torch.dtype = torch.bfloat16, device=None, max_len: int | None = None,
                 num_splits: int = 0):
        super().__init__()
        _check_model_args(dtype, max_len, num_splits)
        self.cfg, self.num_splits = cfg, num_splits
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden, **kw))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.lm_head = None if cfg.tied else nn.Parameter(torch.empty(cfg.vocab, cfg.hidden, **kw))
        self.register_buffer("cos_sin", rope_table(cfg, max_len or cfg.max_position, dtype).to(device),
                             persistent=False)

    def forward(self, tokens, kv_cache, kv_indptr, kv_indices, kv_last_page_len):
        # one token per sequence of the page table (a shorter batch would leave sequences counted
        # but never written); static shapes, so this costs nothing once compiled
        if tokens.dim() != 1 or kv_indptr.shape != (tokens.shape[0] + 1,) or kv_last_page_len.shape != tokens.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)}, kv_indptr {tuple(kv_indptr.shape)}, kv_last_page_len "
                             f"{tuple(kv_last_page_len.shape)}; expected [B], [B + 1] and [B]: one token per sequence "
                             "of the page table")
        if kv_cache.dtype != self.embed.dtype:  # a cast in the append would silently round the cache
            raise ValueError(f"kv_cache is {kv_cache.dtype}; expected the model's dtype {self.embed.dtype} "
                             "(PagedKVCache(model, ...) allocates it so)")
        if not torch.compiler.is_compiling():  # eagerly: what the compiled step reports (BadInputError)
            bad = torch.nonzero((tokens < 0) | (tokens >= self.cfg.vocab)).flatten()
            if len(bad):
                row = int(bad[0])
                raise BadInputError(bad_input_message(BAD_TOKEN, int(tokens[row]), row, self.cfg.vocab))
        x = torch.nn.functional.embedding(tokens, self.embed)
        for layer in self.layers:
            x = layer(x, self.cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, self.num_splits)
        x = torch.ops.mpk.rms_norm(x, self.norm, self.cfg.eps, torch.float32, x.dtype)
        return torch.nn.functional.linear(x, self.embed if self.lm_head is None else self.lm_head)

    def randomize(self, seed: int = 0, scale: float = 0.02) -> "DecoderLM":
        """Random weights (norm weights near 1), drawn on the CPU so every device agrees."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + scale * torch.randn(p.shape, generator=g))
        return self

    def new_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        c, p = self.cfg, self.embed
        return torch.zeros(c.layers, 2, num_pages, c.kv_heads, page_size, c.head_dim, dtype=p.dtype, device=p.device)


# --- checkpoints ---------------------------------------------------------------------------------

def _hf_names(cfg: LLMConfig, i: int) -> dict[str, list[str]]:
    p = f"model.layers.{i}."
    names = {"input_norm": [p + "input_layernorm.weight"], "post_norm": [p + "post_attention_layernorm.weight"],
             "qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
             "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "down": [p + "mlp.down_proj.weight"]}
    if cfg.qk_norm:
        names |= {"q_norm": [p + "self_attn.q_norm.weight"], "k_norm": [p + "self_attn.k_norm.weight"]}
    return names


def _piece_rows(cfg: LLMConfig, attr: str, rows: int) -> list[int]:
    """The rows each checkpoint tensor of a fused weight (q|k|v, gate|up) contributes."""
    if attr == "qkv":
        return [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    return [cfg.inter, cfg.inter] if attr == "gate_up" else [rows]


# Checkpoint tensors a decode step has no use for, by name suffix: the rotary tables some
# transformers versions saved (the model computes its own, rope_table).
_UNUSED_SUFFIXES = (".rotary_emb.inv_freq",)
# safetensors dtypes a weight may be stored in (converted to the model's dtype on loading);
# integer, bool or float8 tensors would be quantized codes or masks, which a cast would misread
_FLOAT_STORAGE = ("BF16", "F16", "F32", "F64")


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.bfloat16, device=None,
                    max_len: int | None = None, num_splits: int = 0, progress: bool | None = None) -> DecoderLM:
    """A ``DecoderLM`` from a local HF checkpoint directory (config.json + *.safetensors, one
    file or shards; with ``model.safetensors.index.json`` the files it names).

    Weights are read one fused weight at a time (host memory holds one, not the checkpoint),
    converted to ``dtype`` and moved to ``device``. Raises ``MpkError`` naming the tensors for a
    missing tensor, a shape the config does not imply, a tensor stored as integers, bools or
    float8, a tensor in two shards, checkpoint tensors the model would not use (biases the
    config does not declare, say), an unreadable file, or a weight that is not finite once
    converted (a float16 load of values past 65504): nothing is dropped or reinterpreted
    silently; all but the last is checked before any weight is read. Loading float16 weights as
    bfloat16 warns (3 mantissa bits lost). ``progress``: a progress bar on stderr (default: when
    stderr is a terminal).
    """
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    _check_model_args(dtype, max_len, num_splits)
    path = Path(path)
    if not path.is_dir():
        raise MpkError(f"{path} is not a directory; expected a checkpoint directory holding config.json and "
                       "*.safetensors")
    cfg = LLMConfig.from_hf(path)
    index = path / "model.safetensors.index.json"  # a sharded checkpoint's map: its files, no others
    files = [path / f for f in _index_files(index)] if index.exists() else sorted(path.glob("*.safetensors"))
    if not files:
        raise MpkError(f"no *.safetensors files in {path}")
    absent = [f.name for f in files if not f.exists()]
    if absent:
        raise MpkError(f"checkpoint {path}: {index.name} names shards that are not there: {_few(absent)}")
    model = DecoderLM(cfg, dtype, "meta", max_len, num_splits)
    # (module, attribute, checkpoint names concatenated along dim 0)
    plan: list[tuple[nn.Module, str, list[str]]] = [(model, "embed", ["model.embed_tokens.weight"]),
                                                    (model, "norm", ["model.norm.weight"])]
    if not cfg.tied:
        plan.append((model, "lm_head", ["lm_head.weight"]))
    plan += [(layer, attr, names) for i, layer in enumerate(model.layers) for attr, names in _hf_names(cfg, i).items()]
    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[Any, str]] = {}  # name -> (open file, its name)
        for f in files:
            try:
                fh = stack.enter_context(safe_open(str(f), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise MpkError(f"checkpoint {path}: {f.name} is not a readable safetensors file ({e})") from None
            for k in fh.keys():
                if k in where:
                    raise MpkError(f"checkpoint {path}: tensor {k} is in both {where[k][1]} and {f.name}")
                where[k] = (fh, f.name)
        wanted = {n for _, _, names in plan for n in names}
        missing = sorted(wanted - where.keys())
        if missing:
            raise MpkError(f"checkpoint {path} lacks {len(missing)} tensors the config implies: {_few(missing)}")
        extra = sorted(k for k in where.keys() - wanted if not k.endswith(_UNUSED_SUFFIXES))
        # a tied model's checkpoint may still hold lm_head.weight: fine if it is the embedding
        tied_head = cfg.tied and "lm_head.weight" in extra
        extra = [k for k in extra if not (tied_head and k == "lm_head.weight")]
        if extra:
            raise MpkError(f"checkpoint {path} holds {len(extra)} tensors a {cfg.family} decoder with this "
                           f"config does not use (it would drop them): {_few(extra)}")

        def meta(name: str):
            return where[name][0].get_slice(name)

        bad = [f"{n} ({meta(n).get_dtype()})" for n in sorted(wanted) if meta(n).get_dtype() not in _FLOAT_STORAGE]
        if bad:
            raise MpkError(f"checkpoint {path}: weights stored in a non-float dtype: {_few(bad)}; "
                           f"expected one of {', '.join(_FLOAT_STORAGE)} (quantized checkpoints are not supported)")
        for owner, attr, names in plan:
            shape = tuple(getattr(owner, attr).shape)
            for n, rows in zip(names, _piece_rows(model.cfg, attr, shape[0])):
                if tuple(meta(n).get_shape()) != (rows,) + shape[1:]:
                    raise MpkError(f"checkpoint tensor {n} has shape {tuple(meta(n).get_shape())}; the config "
                                   f"implies {(rows,) + shape[1:]}")

        def read(name: str) -> torch.Tensor:
            return where[name][0].get_tensor(name)

        if tied_head and not torch.equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
            raise MpkError(f"checkpoint {path}: config.json ties the LM head to the embedding "
                           "(tie_word_embeddings), but lm_head.weight differs from model.embed_tokens.weight")
        stored = {meta(n).get_dtype() for n in wanted}
        if dtype == torch.bfloat16 and "F16" in stored:
            warnings.warn(f"checkpoint {path} stores float16 weights; loading them as bfloat16 drops 3 bits of "
                          "each mantissa (pass dtype=torch.float16 to keep them; mpk's bandwidth-grade decode "
                          "linear takes bfloat16 only)", stacklevel=2)
        numel = {n: math.prod(meta(n).get_shape()) for n in wanted}
        with tqdm(total=sum(numel.values()), unit="param", unit_scale=True, desc=f"loading {path.name}",
                  disable=None if progress is None else not progress) as bar:
            for owner, attr, names in plan:
                t = torch.cat([read(n) for n in names], 0).to(dtype=dtype, device=device)
                bad = _count_non_finite(t)
                if bad:  # a broken checkpoint, or values past dtype's range (float16's 65504)
                    pieces = [read(n) for n in names]
                    overflow = all(_count_non_finite(x) == 0 for x in pieces)
                    wider = "torch.bfloat16 or torch.float32" if dtype == torch.float16 else "torch.float32"
                    raise MpkError(f"checkpoint {path}: {'/'.join(names)} holds {bad} non-finite values as {dtype}" + (
                        f" (the largest stored magnitude is {max(float(x.abs().max()) for x in pieces):.4g}); expected "
                        f"finite weights ({dtype} holds magnitudes up to {torch.finfo(dtype).max:.6g}: load as "
                        f"{wider})" if overflow else
                        "; the checkpoint itself stores inf or NaN there: expected finite weights"))
                setattr(owner, attr, nn.Parameter(t, requires_grad=False))
                bar.update(sum(numel[n] for n in names))
    model.cos_sin = rope_table(cfg, max_len or cfg.max_position, dtype).to(device)
    return model


def _count_non_finite(t: torch.Tensor, chunk: int = 1 << 26) -> int:
    """How many elements of ``t`` are inf or NaN, in chunks (a whole-tensor mask of an LM head
    would take another ~0.6 GB)."""
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


def _index_files(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` maps tensors to."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise MpkError(f"{index} is not a JSON object ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise MpkError(f"{index} has no weight_map of tensor names to shard files; expected "
                       '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}')
    outside = sorted(f for f in set(weight_map.values()) if Path(f).name != f or f in (".", ".."))
    if outside:
        raise MpkError(f"{index} maps tensors to files outside its directory: {_few(outside)}; expected shard "
                       "file names beside it")
    return sorted(set(weight_map.values()))


def _indices(value: Any) -> list[int] | None:
    """An integer (Python or NumPy, not a bool) or an iterable of them (a list, range or array) as
    a list of ints; None for anything else."""
    def one(v: Any) -> int | None:
        return None if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) else int(v)

    if one(value) is not None:
        return [one(value)]
    try:
        items = [one(v) for v in value]
    except TypeError:
        return None
    return None if None in items else items


def _is_count(value: Any, least: int = 0) -> bool:
    """``value`` is an int (not a bool) ≥ ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_model_args(dtype: torch.dtype, max_len: int | None, num_splits: int) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype!r}; expected torch.bfloat16, torch.float16 or torch.float32")
    if max_len is not None and not _is_count(max_len, 1):
        raise ValueError(f"max_len={max_len!r}; expected None (the config's max_position) or an int ≥ 1")
    if not _is_count(num_splits):
        raise ValueError(f"num_splits={num_splits!r}; expected an int ≥ 0 (0: the compiler picks)")


def _few(names: list[str], n: int = 6) -> str:
    """The first n names, and how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# --- page table ----------------------------------------------------------------------------------

class PagedKVCache:
    """Host-side page allocator and the BSR page table a decode step reads.

    Pages are handed out in order from a free list; ``grow()`` counts one new token per
    sequence (allocating a page when the last one is full) and writes the table tensors in
    place, so their addresses stay fixed across steps (CUDA graphs and mpk's bound buffers
    rely on that).
    """

    def __init__(self, model: DecoderLM, batch: int, max_len: int, page_size: int):
        if not is_page_size(page_size):
            raise ValueError(f"page_size {page_size!r}; expected {PAGE_SIZES}")
        if not (_is_count(batch, 1) and _is_count(max_len, 1)):
            raise ValueError(f"batch {batch!r}, max_len {max_len!r}; expected both ints ≥ 1")
        positions = model.cos_sin.shape[0]
        if max_len > positions:  # rope reads row len − 1 of the table; past it the step would fault
            raise ValueError(f"max_len {max_len} exceeds the model's rope table of {positions} positions; build "
                             f"the model with max_len ≥ {max_len} (DecoderLM / load_pretrained)")
        self.batch, self.page_size, self.max_len = batch, page_size, max_len
        self.pages_per_seq = -(-max_len // page_size)
        num_pages = batch * self.pages_per_seq
        dev = model.embed.device
        self.cache = model.new_cache(num_pages, page_size)
        self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(num_pages, dtype=torch.int32, device=dev)
        self.kv_last_page_len = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.reset()

    def reset(self, seqs: int | list[int] | None = None) -> None:
        """Empty sequences ``seqs`` (an index or a list; default: every one), their pages back to
        the free list, keeping the cache tensor and the table tensors (and their addresses): the
        next prompt needs no second cache, and a finished sequence's slot can take a new prompt
        while the others decode on. A step writes one token of every sequence, so ``grow`` the
        emptied ones before the next step."""
        if seqs is None:
            num_pages = self.batch * self.pages_per_seq
            # Pages interleaved across sequences, so a sequence's pages are not contiguous (the
            # kernels must follow the table, not assume an order).
            self.free = [p for i in range(self.pages_per_seq) for p in range(i, num_pages, self.pages_per_seq)][::-1]
            self.owned = np.zeros((self.batch, self.pages_per_seq), np.int32)  # row b: sequence b's pages in order
            self.lens = [0] * self.batch
        else:
            chosen = _indices(seqs)
            if chosen is None or not all(0 <= b < self.batch for b in chosen) or len(set(chosen)) < len(chosen):
                raise ValueError(f"reset({seqs!r}); expected a sequence index in [0, {self.batch}), a list of "
                                 "distinct ones, or None (every sequence)")
            for b in chosen:
                self.free.extend(self.owned[b, : -(-self.lens[b] // self.page_size)][::-1].tolist())
                self.lens[b] = 0
        self._write()

    def grow(self, n: int | list[int] = 1) -> None:
        """Count ``n`` more tokens in every sequence, or ``n[b]`` in sequence b (the next decode
        step writes each sequence's last token). A refused grow changes nothing."""
        counts = list(n) if isinstance(n, (list, tuple)) else [n] * self.batch
        if len(counts) != self.batch or not all(_is_count(k) for k in counts):
            raise ValueError(f"grow({n!r}); expected a count ≥ 0 (an int) or one per sequence ({self.batch})")
        for b, k in enumerate(counts):
            if self.lens[b] + k > self.max_len:
                raise MpkError(f"sequence {b} would reach {self.lens[b] + k} tokens; max_len is {self.max_len}")
        for b, k in enumerate(counts):
            have = -(-self.lens[b] // self.page_size)
            self.lens[b] += k
            for i in range(have, -(-self.lens[b] // self.page_size)):
                self.owned[b, i] = self.free.pop()
        self._write()

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def _write(self) -> None:
        lens = np.asarray(self.lens, np.int64)
        pages = -(-lens // self.page_size)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        flat = np.concatenate([self.owned[b, :k] for b, k in enumerate(pages)]).astype(np.int32)
        last = np.where(lens > 0, (lens - 1) % self.page_size + 1, 0).astype(np.int32)
        # From pinned host memory, asynchronously: a blocking copy would wait for the steps still
        # queued on the stream (sync=False), stalling the host each step. The caching host
        # allocator keeps each staging block until its copy has run.
        for dst, src in ((self.kv_indptr, indptr), (self.kv_indices[: len(flat)], flat), (self.kv_last_page_len, last)):
            host = torch.from_numpy(src)
            if dst.is_cuda:
                host = host.pin_memory()
            dst.copy_(host, non_blocking=dst.is_cuda)
