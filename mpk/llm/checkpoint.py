"""``load_pretrained``: a Hugging Face safetensors checkpoint (one file or shards with an index)
into a ``DecoderLM``, the q|k|v and gate|up weights fused as the model holds them; nothing dropped
or silently converted."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpk.errors import MpkError
from mpk.llm.config import LLMConfig, few, rope_table
from mpk.llm.model import DecoderLM, check_model_args


def _hf_names(cfg: LLMConfig, i: int) -> dict[str, list[str]]:
    p = f"model.layers.{i}."
    names = {"input_norm": [p + "input_layernorm.weight"], "post_norm": [p + "post_attention_layernorm.weight"],
             "qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
             "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "down": [p + "mlp.down_proj.weight"]}
    if cfg.qk_norm:
        names |= {"q_norm": [p + "self_attn.q_norm.weight"], "k_norm": [p + "self_attn.k_norm.weight"]}
    return names


def piece_rows(cfg: LLMConfig, attr: str, rows: int) -> list[int]:
    """The rows each checkpoint tensor of a fused weight (q|k|v, gate|up) contributes."""
    if attr == "qkv":
        return [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    return [cfg.inter, cfg.inter] if attr == "gate_up" else [rows]


def weight_plan(model: DecoderLM) -> list[tuple[nn.Module, str, list[str]]]:
    """Every weight of ``model`` as (module, attribute, the HF checkpoint names concatenated
    along dim 0 to make it): the q|k|v and gate|up fusing, shared by every checkpoint format."""
    cfg = model.cfg
    plan: list[tuple[nn.Module, str, list[str]]] = [(model, "embed", ["model.embed_tokens.weight"]),
                                                    (model, "norm", ["model.norm.weight"])]
    if not cfg.tied:
        plan.append((model, "lm_head", ["lm_head.weight"]))
    return plan + [(layer, attr, names) for i, layer in enumerate(model.layers)
                   for attr, names in _hf_names(cfg, i).items()]


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

    check_model_args(dtype, max_len, num_splits)
    if not isinstance(path, (str, os.PathLike)):
        raise MpkError(f"path={path!r}; expected a checkpoint directory (str or os.PathLike)")
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
        raise MpkError(f"checkpoint {path}: {index.name} names shards that are not there: {few(absent)}")
    model = DecoderLM(cfg, dtype, "meta", max_len, num_splits)
    plan = weight_plan(model)
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
            raise MpkError(f"checkpoint {path} lacks {len(missing)} tensors the config implies: {few(missing)}")
        extra = sorted(k for k in where.keys() - wanted if not k.endswith(_UNUSED_SUFFIXES))
        # a tied model's checkpoint may still hold lm_head.weight: fine if it is the embedding
        tied_head = cfg.tied and "lm_head.weight" in extra
        extra = [k for k in extra if not (tied_head and k == "lm_head.weight")]
        if extra:
            raise MpkError(f"checkpoint {path} holds {len(extra)} tensors a {cfg.family} decoder with this "
                           f"config does not use (it would drop them): {few(extra)}")

        def meta(name: str):
            return where[name][0].get_slice(name)

        bad = [f"{n} ({meta(n).get_dtype()})" for n in sorted(wanted) if meta(n).get_dtype() not in _FLOAT_STORAGE]
        if bad:
            raise MpkError(f"checkpoint {path}: weights stored in a non-float dtype: {few(bad)}; "
                           f"expected one of {', '.join(_FLOAT_STORAGE)} (quantized checkpoints are not supported)")
        for owner, attr, names in plan:
            shape = tuple(getattr(owner, attr).shape)
            for n, rows in zip(names, piece_rows(model.cfg, attr, shape[0])):
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
                bad = count_non_finite(t)
                if bad:  # a broken checkpoint, or values past dtype's range (float16's 65504)
                    pieces = [read(n) for n in names]
                    overflow = all(count_non_finite(x) == 0 for x in pieces)
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


def count_non_finite(t: torch.Tensor, chunk: int = 1 << 26) -> int:
    """How many elements of ``t`` are inf or NaN, in chunks (a whole-tensor mask of an LM head
    would take another ~0.6 GB)."""
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


def _index_files(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` maps tensors to."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise MpkError(f"{index} is not a JSON object ({e})") from None
    except OSError as e:
        raise MpkError(f"{index} cannot be read ({e.strerror}); expected a JSON file mapping tensors to shards") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise MpkError(f"{index} has no weight_map of tensor names to shard files; expected "
                       '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}')
    outside = sorted(f for f in set(weight_map.values()) if Path(f).name != f or f in (".", ".."))
    if outside:
        raise MpkError(f"{index} maps tensors to files outside its directory: {few(outside)}; expected shard "
                       "file names beside it")
    return sorted(set(weight_map.values()))
