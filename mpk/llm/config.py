"""``LLMConfig``: the fields of a Hugging Face ``config.json`` that a Llama / Qwen3 decode step
needs, checked, and ``SHAPES``, the public models' shapes (random weights are enough to time them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpk.errors import ConfigError, MpkError

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


# Upper bounds of a config's sizes, each far above every Llama / Qwen3 checkpoint's, so a
# corrupt or hostile config is refused before anything is allocated for it
MAX_SIZES = {"hidden_size": 1 << 20, "intermediate_size": 1 << 22, "vocab_size": 1 << 24,
             "num_attention_heads * head_dim": 1 << 20, "num_attention_heads": 1 << 20, "head_dim": 1024, "num_hidden_layers": 1024,
             "max_position_embeddings": 1 << 22}
_SIZE_WHY = {"hidden_size": "a weight's rows are indexed with int32 in the task tables",
             "intermediate_size": "a weight's rows are indexed with int32 in the task tables",
             "vocab_size": "the LM head's rows are indexed with int32 in the task tables",
             "num_attention_heads * head_dim": "the q projection's rows are indexed with int32",
             "head_dim": "the attention kernels hold a head in on-chip memory",
             "num_hidden_layers": "each layer is a module and a set of ops in the compiled graph",
             "num_attention_heads": "the q projection's rows are indexed with int32",
             "max_position_embeddings": "the rope table of that many positions is built on loading; "
                                        "4M positions already take 2 GB"}


def _at_most(where: str, key: str, v: int) -> None:
    if key in MAX_SIZES and v > MAX_SIZES[key]:
        raise ConfigError(f"{where}: {key} {v} is more than {MAX_SIZES[key]}; expected at most that "
                          f"({_SIZE_WHY[key]})")


def _check_sliding_fields(where: str, config: dict[str, Any]) -> None:
    """ConfigError naming the field unless the sliding-window fields have the types
    transformers reads (``layer_types`` a list of strings, the rest ints or null)."""
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ConfigError(f"{where}: layer_types {types!r}; expected a list of strings such as "
                          '["full_attention", ...] or null')
    for key in ("max_window_layers", "sliding_window"):
        v = config.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"{where}: {key} {v!r}; expected an int >= 0 or null")
    if not isinstance(config.get("use_sliding_window", False), (bool, type(None))):
        raise ConfigError(f"{where}: use_sliding_window {config['use_sliding_window']!r}; expected true or false")


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
    try:
        ok = (isinstance(v, int) and not isinstance(v, bool)) if kind is int else \
            (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    except OverflowError:  # an int past float's range (JSON integers are unbounded)
        ok = False
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
                config = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not valid JSON: {e}") from None
            except UnicodeDecodeError as e:  # a binary file (weights saved under the config's name, say)
                raise ConfigError(f"{where} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                                  "expected a Hugging Face config.json") from None
            except OSError as e:
                raise ConfigError(f"{where} cannot be read ({e.strerror}); expected a Hugging Face config.json "
                                  "(or a checkpoint directory holding one)") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{where} holds a {type(config).__name__}; expected a JSON object")
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not supported; "
                              f"expected one of {sorted(FAMILIES)}")
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ConfigError(f"{where} lacks {', '.join(missing)}; a {model_type} decoder needs "
                              f"{', '.join(_REQUIRED)}")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ConfigError(f"{where}: projection biases (attention_bias / mlp_bias) are not supported")
        act = config.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in ("silu", "swish"):  # transformers' two names of x·sigmoid(x)
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
            _at_most(where, key, config[key])  # before anything sized by it (the layer list below)
        _check_sliding_fields(where, config)
        sliding = _sliding_layers(config)
        if sliding:
            raise ConfigError(f"{where}: layers {few([str(i) for i in sliding])} use sliding-window attention, "
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
        sizes = {"head_dim": head_dim, "num_attention_heads * head_dim": heads * head_dim,
                 "max_position_embeddings": max_position}
        for key, v in sizes.items():
            _at_most(where, key, v)
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

# Public model shapes (random-weight benchmarks, inspection, tests): first the decode
# benchmark's, then other public checkpoints' as their config.json gives them, which
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


def is_count(value: Any, least: int = 0) -> bool:
    """``value`` is an int (not a bool) ≥ ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def few(names: list[str], n: int = 6) -> str:
    """The first n names, and how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
