"""Parity harness: the same random weights in Hugging Face transformers and in ``DecoderLM``,
teacher-forced decoding, and the comparison numbers the parity tests assert on."""

from __future__ import annotations

import tempfile
from typing import Callable

import torch

from mpk.models.llm import DecoderLM, LLMConfig, PagedKVCache, load_pretrained


def hf_twin(cfg: LLMConfig, seed: int, dtype: torch.dtype, device=None, num_splits: int = 0,
            max_len: int = 256):
    """(transformers model, DecoderLM) with identical random weights: the HF model is created
    from ``cfg.to_hf()``, saved as safetensors and loaded back by ``load_pretrained``."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # HF's init leaves norm weights at exactly 1; perturb them so they matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        ours = load_pretrained(tmp, dtype, device, max_len=max_len, num_splits=num_splits)
    return hf.to(device), ours


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits [B, T, V] of a whole sequence in one causal forward."""
    with torch.no_grad():
        return hf(input_ids=tokens, use_cache=False).logits.float()


def decode_logits(step: Callable, model: DecoderLM, tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Teacher-forced logits [B, T, V] from T decode steps of ``step`` (``model`` or its
    compiled form) over a fresh paged cache."""
    B, T = tokens.shape
    kv = PagedKVCache(model, B, T, page_size)
    out = []
    with torch.no_grad():
        for t in range(T):
            kv.grow(1)
            out.append(step(tokens[:, t].contiguous(), *kv.args()).float())
    return torch.stack(out, 1)


def compare_logits(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement over all (sequence, step) pairs and the largest error relative to the
    reference's largest |logit| at that step."""
    top1 = (out.argmax(-1) == ref.argmax(-1)).double().mean().item()
    err = (out.double() - ref.double()).abs().amax(-1) / ref.double().abs().amax(-1).clamp_min(1e-30)
    return {"top1": top1, "max_rel": err.max().item()}
