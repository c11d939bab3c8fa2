"""``load_gguf``: a llama.cpp GGUF file (llama or qwen3 architecture) into a ``DecoderLM``.

The config comes from the file's metadata (read as transformers' GGUF loader reads it, then
checked by ``LLMConfig.from_hf``), the weights are dequantized to float at load (the types in
``SUPPORTED_TYPES``) and fused q|k|v, gate|up as ``load_pretrained`` fuses HF checkpoints
(``checkpoint.weight_plan``). llama.cpp's converter permutes the q and k rows of llama models
for its interleaved rope; they are permuted back here to the rotate-half layout the model's
rope (HF's) expects, as transformers does.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mpk.errors import ConfigError, MpkError
from mpk.llm.checkpoint import count_non_finite, piece_rows, weight_plan
from mpk.llm.config import LLMConfig, few, rope_inv_freq, rope_table
from mpk.llm.model import DecoderLM, check_model_args

ARCHITECTURES = ("llama", "qwen3")  # GGUF's general.architecture; the same names as mpk's families
# Tensor types dequantized at load: floats, and the ggml block quants of common checkpoints
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_MAGIC = b"GGUF"

# GGUF metadata key (after "<arch>.") -> HF config field, as transformers' integrations/ggml.py
# maps them for llama and qwen3 (key_length, qwen3's head_dim, is written by llama.cpp's
# converter whenever the HF config has head_dim)
_CONFIG_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
                "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}
# HF checkpoint names -> GGUF tensor names (llama.cpp's gguf-py tensor mapping)
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling, as a divisor of each frequency


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a HF checkpoint tensor name (``model.layers.3.mlp.up_proj.weight``
    -> ``blk.3.ffn_up.weight``)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def check_gguf_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path, after checking that it is a file that starts as GGUF files do
    (``MpkError`` naming what it is otherwise); reads 4 bytes."""
    if not isinstance(path, (str, os.PathLike)):
        raise MpkError(f"path={path!r}; expected a GGUF file path (str or os.PathLike)")
    path = Path(path)
    if not path.is_file():
        raise MpkError(f"{path} {'is a directory' if path.is_dir() else 'does not exist'}; expected a GGUF file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MpkError(f"{path} cannot be read ({e.strerror}); expected a GGUF file") from None
    if magic != _MAGIC:
        raise MpkError(f"{path} is not a GGUF file: it starts with {magic!r}; expected {_MAGIC!r}")
    return path


def read_gguf(path: str | os.PathLike):
    """(a ``gguf.GGUFReader`` of ``path``, its architecture). The reader parses the metadata
    (seconds for a 49k-token vocabulary) and memory-maps the tensors (read when used). Raises
    ``MpkError`` for a path that is not a readable GGUF file and ``ConfigError`` for an
    architecture other than ``ARCHITECTURES``."""
    from gguf import GGUFReader

    path = check_gguf_file(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # a truncated or corrupt header or tensor table
        raise MpkError(f"{path} is not a readable GGUF file ({e})") from None
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: general.architecture {arch!r} is not supported; expected one of "
                          f"{list(ARCHITECTURES)}")
    return reader, arch


def field_value(reader, key: str) -> Any:
    """A metadata value (a str, number, bool or list), None when the key is absent."""
    f = reader.get_field(key)
    return None if f is None else f.contents()


def hf_config(reader, arch: str, where: str) -> dict[str, Any]:
    """The HF config dict the file's metadata describes, for ``LLMConfig.from_hf``: the keys
    transformers maps, the vocabulary from the embedding when the metadata omits it, tied
    embeddings when there is no ``output.weight`` (transformers' rule), and Llama 3 rope
    scaling from ``rope_freqs.weight``. ConfigError for a rope scaling it does not compute."""
    config: dict[str, Any] = {"model_type": arch}
    for key, name in _CONFIG_KEYS.items():
        v = field_value(reader, f"{arch}.{key}")
        if v is not None:
            config[name] = v
    if arch == "llama" and "head_dim" not in config and field_value(reader, "llama.rope.dimension_count"):
        config["head_dim"] = field_value(reader, "llama.rope.dimension_count")  # as transformers reads llama
    value_length = field_value(reader, f"{arch}.attention.value_length")
    if value_length is not None and value_length != config.get("head_dim"):
        raise ConfigError(f"{where}: {arch}.attention.value_length {value_length} differs from key_length "
                          f"{config.get('head_dim')}; expected one head_dim for k and v")
    tensors = {t.name: t for t in reader.tensors}
    if "vocab_size" not in config and "token_embd.weight" in tensors:
        config["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])  # ggml order: rows last
    config["tie_word_embeddings"] = "output.weight" not in tensors
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{where}: {arch}.rope.scaling.type {scaling!r} is not supported; expected none (or Llama "
                          f"3 scaling, which llama.cpp stores as {ROPE_FREQS})")
    if ROPE_FREQS in tensors:
        config["rope_scaling"] = _llama3_scaling(_dequantize(tensors[ROPE_FREQS]).reshape(-1).astype(np.float64),
                                                 config, where)
    return config


def _llama3_scaling(divisors: np.ndarray, config: dict[str, Any], where: str) -> dict[str, Any]:
    """HF's Llama 3 ``rope_scaling`` whose frequencies are ``inv_freq / divisors`` (what
    ``rope_freqs.weight`` holds). Meta's parameters (low 1, high 4, original 8192) first; else
    fitted to the transition band, where 1 / divisor is linear in 1 / wavelength (its slope and
    intercept fix original/low and original/high, the only ways the parameters enter). Verified
    against the divisors; ConfigError when none reproduces them."""
    theta = float(config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv.shape:
        raise ConfigError(f"{where}: {ROPE_FREQS} has {divisors.size} entries; expected head_dim / 2 = {inv.size}")
    factor = float(divisors.max())
    candidates = [{"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}]
    mid = (divisors > 1) & (divisors < factor)
    if mid.sum() >= 2 and factor > 1:
        # smooth = (old / wavelen − low) / (high − low) = a / wavelen − b
        smooth = (1 / divisors[mid] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(inv[mid] / (2 * math.pi), smooth, 1)
        if a > 0 and -minus_b > 0:
            old = round(a / -minus_b)
            low = old * -minus_b / a
            candidates.append({"factor": factor, "low_freq_factor": low, "high_freq_factor": low + old / a,
                               "original_max_position_embeddings": old})
    for c in candidates:
        rope = {"rope_type": "llama3"} | c
        cfg = LLMConfig("llama", 1, 1, 1, 1, 1, head_dim, 1, False, 1e-6, theta, rope)
        if np.allclose(rope_inv_freq(cfg).double().numpy(), inv / divisors, rtol=1e-5, atol=0):
            return rope
    raise ConfigError(f"{where}: {ROPE_FREQS} (frequency divisors {few([f'{d:.4g}' for d in divisors])}) is not "
                      "Llama 3 rope scaling of any parameters; expected the divisors llama.cpp's converter writes for "
                      "a rope_scaling of rope_type llama3")


def _dequantize(t) -> np.ndarray:
    """A reader tensor as float32 [rows, cols] (numpy order), dequantized, writable (F32 data
    is a view of the read-only memory map)."""
    from gguf.quants import dequantize

    out = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    return out if out.flags.writeable else out.copy()


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of a llama q or k weight (``heads`` heads):
    within each head it interleaves the two rotate-half halves (rows i and i + d/2 become
    2i and 2i + 1) for ggml's pairwise rope; this restores HF's order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device=None, max_len: int | None = None,
              progress: bool | None = None) -> DecoderLM:
    """A ``DecoderLM`` from a GGUF file of a llama or qwen3 model, its weights dequantized to
    ``dtype`` and moved to ``device``; ``max_len``: the rope table's positions (default the
    file's context length); ``progress``: a progress bar over the tensors on stderr (default:
    when stderr is a terminal).

    Raises ``MpkError`` for a path that is not a readable GGUF file, a missing tensor, a
    tensor the model would not use, a shape the config does not imply, a tensor type outside
    ``SUPPORTED_TYPES`` (all checked before any weight is dequantized) or non-finite weights;
    ``ConfigError`` for an architecture other than llama / qwen3 or metadata ``LLMConfig``
    refuses.
    """
    from tqdm import tqdm

    check_model_args(dtype, max_len, 0)
    reader, arch = read_gguf(path)
    where = str(path)
    cfg = LLMConfig.from_hf(hf_config(reader, arch, where))
    model = DecoderLM(cfg, dtype, "meta", max_len)
    plan = [(owner, attr, [gguf_name(n) for n in names]) for owner, attr, names in weight_plan(model)]
    tensors = {t.name: t for t in reader.tensors}
    wanted = {n for _, _, names in plan for n in names}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise MpkError(f"{where} lacks {len(missing)} tensors a {arch} model with its metadata has: {few(missing)}")
    extra = sorted(tensors.keys() - wanted - {ROPE_FREQS})
    if extra:
        raise MpkError(f"{where} holds {len(extra)} tensors a {arch} decoder with this config does not use (it would "
                       f"drop them): {few(extra)}")
    bad = [f"{n} ({tensors[n].tensor_type.name})" for n in sorted(wanted)
           if tensors[n].tensor_type.name not in SUPPORTED_TYPES]
    if bad:
        raise MpkError(f"{where}: tensors of unsupported types: {few(bad)}; expected one of "
                       f"{', '.join(SUPPORTED_TYPES)}")
    for owner, attr, names in plan:
        shape = tuple(getattr(owner, attr).shape)
        for n, rows in zip(names, piece_rows(cfg, attr, shape[0])):
            have = tuple(int(d) for d in reversed(tensors[n].shape))  # ggml lists dims innermost first
            if have != (rows,) + shape[1:]:
                raise MpkError(f"{where}: tensor {n} has shape {have}; the metadata implies {(rows,) + shape[1:]}")
    # llama.cpp permutes q and k of llama models only (qwen3's rope is already rotate-half there)
    heads = {"attn_q": cfg.heads, "attn_k": cfg.kv_heads} if arch == "llama" else {}
    with tqdm(total=len(wanted), unit="tensor", desc=f"loading {Path(path).name}",
              disable=None if progress is None else not progress) as bar:
        for owner, attr, names in plan:
            pieces = []
            for n in names:
                w = torch.from_numpy(_dequantize(tensors[n]))
                kind = n.split(".")[-2]
                pieces.append(unpermute_rope_rows(w, heads[kind]) if kind in heads else w)
                bar.update(1)
            t = torch.cat(pieces, 0).to(dtype=dtype, device=device)
            if not bool(torch.isfinite(t).all()):  # one pass; counted only to word the error
                raise MpkError(f"{where}: {'/'.join(names)} holds {count_non_finite(t)} non-finite values as {dtype}; "
                               "expected finite weights" + (" (load as torch.float32)" if dtype != torch.float32 else ""))
            setattr(owner, attr, nn.Parameter(t, requires_grad=False))
    model.cos_sin = rope_table(cfg, max_len or cfg.max_position, dtype).to(device)
    return model
