"""Parity harness: the same random weights in Hugging Face transformers and in ``DecoderLM``,
teacher-forced decoding, and the comparison numbers the parity tests assert on."""

from __future__ import annotations

import tempfile
from typing import Callable

import torch

from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, load_pretrained
from mpk.llm.checkpoint import weight_plan


def hf_model(cfg: LLMConfig, seed: int, dtype: torch.dtype, device=None, init_std: float = 0.1):
    """A transformers model of ``cfg`` with random weights drawn from ``seed`` (HF's init at
    std ``init_std``, norm weights perturbed), in ``dtype`` on ``device``, in eval mode.
    ``init_std``: HF's initializer_range; above its 0.02 default so that random models have
    decisive next-token logits (at 0.02 a small model's logits are near-ties everywhere and
    top-1 agreement measures rounding noise rather than correctness)."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf(), initializer_range=init_std)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):  # initialised where it runs: a 1.7B model inits in seconds on a GPU
        try:
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype)
    with torch.no_grad():  # HF's init leaves norm weights at exactly 1; perturb them so they matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


def hf_twin(cfg: LLMConfig, seed: int, dtype: torch.dtype, device=None, num_splits: int = 0,
            max_len: int = 256, init_std: float = 0.1):
    """(transformers model, DecoderLM) with identical random weights (``hf_model``): the HF
    model is saved as safetensors and loaded back by ``load_pretrained``, so the loader is part
    of what a parity test checks."""
    hf = hf_model(cfg, seed, dtype, device, init_std)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        ours = load_pretrained(tmp, dtype, device, max_len=max_len, num_splits=num_splits)
    return hf, ours


def copy_hf_weights(hf, model: DecoderLM) -> DecoderLM:
    """Copy a transformers model's weights into ``model`` (same config) in memory, converted
    to its dtype and device (a model too large to save and load back in a benchmark)."""
    state = hf.state_dict()
    with torch.no_grad():
        for owner, attr, names in weight_plan(model):
            getattr(owner, attr).copy_(torch.cat([state[n] for n in names], 0))
    return model


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


DECISIVE_MARGIN = 0.05


def compare_logits(out: torch.Tensor, ref: torch.Tensor, margin: float = DECISIVE_MARGIN) -> dict[str, float]:
    """Top-1 agreement over all (sequence, step) pairs; the same over the *decisive* pairs,
    where the reference's best logit leads the second by more than ``margin`` × its largest
    |logit| (bf16 rounding alone moves logits by ~2% of that on random models, so closer
    calls are coin flips even between transformers' own bf16 and fp32 runs); and the largest
    and the median over steps of the error relative to the reference's largest |logit| at that
    step (the median is the robust one to compare two bf16 runs by)."""
    scale = ref.double().abs().amax(-1).clamp_min(1e-30)
    best2 = ref.double().topk(2, dim=-1).values
    decisive = (best2[..., 0] - best2[..., 1]) > margin * scale
    agree = out.argmax(-1) == ref.argmax(-1)
    err = (out.double() - ref.double()).abs().amax(-1) / scale
    return {"top1": agree.double().mean().item(),
            "top1_decisive": agree[decisive].double().mean().item() if decisive.any() else float("nan"),
            "decisive_share": decisive.double().mean().item(), "max_rel": err.max().item(),
            "median_rel": err.median().item()}


def greedy_decode(step: Callable, model: DecoderLM, prompt: torch.Tensor, steps: int, page_size: int) -> torch.Tensor:
    """[B, steps] greedy tokens of ``step`` after feeding ``prompt`` [B, P] one position per
    step, over a fresh paged cache of P + steps positions (``decode_logits``' for the same
    tokens: one compiled graph serves both)."""
    B, P = prompt.shape
    kv = PagedKVCache(model, B, P + steps, page_size)
    out, token = [], prompt[:, 0]
    with torch.no_grad():
        for t in range(P + steps - 1):
            kv.grow(1)
            logits = step(token.contiguous(), *kv.args())
            token = prompt[:, t + 1] if t + 1 < P else logits.argmax(-1)
            if t + 1 >= P:
                out.append(token)
    return torch.stack(out, 1)
