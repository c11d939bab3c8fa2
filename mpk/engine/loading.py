"""``load_model``: a ``DecoderLM`` and its tokenizer from a local Hugging Face directory, a
``.gguf`` file, (None) mpk's default model, or a ``LoadedModel`` built in the process;
``eos_ids``: the tokens that end generation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpk.errors import MpkError, OptionError
from mpk.llm.model import DecoderLM


@dataclass(frozen=True)
class LoadedModel:
    """A model built in the process (``LLM.from_model``), taken as it is: no checkpoint is read.
    ``tokenizer`` None: prompts are token ids and outputs have no text."""

    model: DecoderLM
    tokenizer: Any
    eos_ids: frozenset[int]


def eos_ids(model_dir: str | os.PathLike | None, tokenizer_eos: int | None) -> frozenset[int]:
    """The ids that end generation: the tokenizer's end-of-sequence token and those the
    checkpoint's generation_config.json names (Llama 3 instruct models stop at several)."""
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    config = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if config is not None and config.exists():
        try:
            doc = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise MpkError(f"{config} is not valid JSON: {e}") from None
        named = doc.get("eos_token_id") if isinstance(doc, dict) else None
        named = [] if named is None else named if isinstance(named, list) else [named]
        if not isinstance(doc, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in named):
            raise MpkError(f"{config}: expected a JSON object whose eos_token_id is a token id or a list of them; "
                           f"got {doc.get('eos_token_id') if isinstance(doc, dict) else doc!r}")
        ids |= set(named)
    return frozenset(ids)


def load_model(model: str | os.PathLike | LoadedModel | None, dtype: torch.dtype, device: torch.device,
               max_len: int) -> tuple[DecoderLM, Any, frozenset[int]]:
    """(model, tokenizer, EOS ids) for ``model``: a directory with config.json, *.safetensors
    and a tokenizer; a path ending in .gguf; None for the default model (a GGUF); a
    ``LoadedModel``, which must already be on ``device`` in ``dtype``."""
    if isinstance(model, LoadedModel):
        have = model.model.embed
        if have.dtype != dtype or have.device != device:
            raise OptionError(f"dtype={dtype}, device={device} for a model in {have.dtype} on {have.device}; "
                              "expected the model's own (LLM.from_model passes them)")
        return model.model, model.tokenizer, model.eos_ids
    if model is None:
        from mpk.llm.default_model import default_model_path

        model = default_model_path()
    path = Path(model)
    if path.suffix == ".gguf":
        from mpk.llm.gguf import load_gguf
        from mpk.llm.tokenizer import load_tokenizer

        if not path.is_file():
            raise MpkError(f"model {str(model)!r}: no such GGUF file")
        tokenizer = load_tokenizer(path)
        return load_gguf(path, dtype, device, max_len), tokenizer, eos_ids(None, tokenizer.eos_token_id)
    if not path.is_dir():
        raise MpkError(f"model {str(model)!r} is neither a checkpoint directory (config.json, *.safetensors, a "
                       "tokenizer) nor a .gguf file")
    from transformers import AutoTokenizer

    from mpk.llm.checkpoint import load_pretrained

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise MpkError(f"the tokenizer in {path} does not load ({e}); expected tokenizer.json or the files "
                       "transformers' AutoTokenizer reads") from e
    return load_pretrained(path, dtype, device, max_len=max_len), tokenizer, eos_ids(path, tokenizer.eos_token_id)
