"""A tiny random checkpoint directory for engine tests: Hugging Face weights (random, as
``mpk.testing.parity.hf_twin`` draws them) and an offline byte-level tokenizer with a chat
template, as ``mpk.LLM`` loads them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mpk.llm.config import LLMConfig

SPECIALS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>")
VOCAB = 256 + len(SPECIALS)  # every byte, then the special tokens
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(vocab_size: int = VOCAB):
    """A ``PreTrainedTokenizerFast`` with one token per byte (ids 0…255), ``SPECIALS`` after
    them (EOS is "<|eos|>") and, up to ``vocab_size``, filler tokens "<id>" (a model-sized
    vocabulary for benchmarks: any id decodes)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    if vocab_size < VOCAB:
        raise ValueError(f"vocab_size={vocab_size}; expected at least {VOCAB} (the bytes and the special tokens)")
    vocab = dict(_BYTES)  # the byte-level alphabet's character of byte b → id b
    vocab |= {s: 256 + i for i, s in enumerate(SPECIALS)} | {f"<{i}>": i for i in range(VOCAB, vocab_size)}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                               additional_special_tokens=list(SPECIALS[2:]))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel maps bytes to): character → byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _gpt2_bytes()


def tiny_checkpoint(path: str | Path, cfg: LLMConfig, seed: int, init_std: float = 0.1,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Save a random model of ``cfg`` (in ``dtype``) and ``byte_tokenizer(cfg.vocab)`` into
    ``path``; EOS (generation_config.json) is the tokenizer's."""
    import transformers

    path = Path(path)
    tok = byte_tokenizer(cfg.vocab)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf(), initializer_range=init_std,
                                               eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    with torch.no_grad():  # HF's init leaves norm weights at exactly 1; perturb them so they matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def seeded_checkpoint(path: str | Path, **config) -> Path:
    """The engine's and the server's tests' model at ``path``: a tiny random Qwen3 (2 layers,
    hidden 64, qk-norm; ``config`` overrides fields) with the byte tokenizer, seeded from the
    run's ``MPK_TEST_SEED``."""
    import os

    from mpk.testing.decode import small_config

    return tiny_checkpoint(path, small_config("qwen3", vocab=VOCAB, **config), int(os.environ["MPK_TEST_SEED"]))


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread meanwhile: tiny steps on a shared machine only wait on each other
    with several (10–50× slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- comparing generated tokens ------------------------------------------------------------

def teacher_forced_agreement(model, prompts: list[list[int]], generated: list[list[int]]) -> dict[str, float]:
    """Teacher-forced over each prompt and its generated tokens, the float32 twin of ``model``:
    the share of generated tokens that are the twin's argmax where the twin is decisive (its
    best logit leads by more than DECISIVE_MARGIN of its largest |logit|: bf16 rounding alone
    moves logits by about that much), and the share of decisive positions."""
    from mpk.llm import PagedKVCache, TokenBuckets
    from mpk.testing.decode import float32_twin
    from mpk.testing.parity import DECISIVE_MARGIN

    twin = float32_twin(model)
    longest = max(len(p) + len(g) for p, g in zip(prompts, generated))
    steps = TokenBuckets(twin, PagedKVCache(twin, 1, longest, 16), buckets=[longest], logits="all", eager=True)
    agree = decisive = total = 0
    for p, g in zip(prompts, generated):
        steps.cache.reset()
        with torch.no_grad():
            logits = steps.step([p + g]).double()[len(p) - 1: len(p) + len(g) - 1]
        best2 = logits.topk(2, dim=-1).values
        sure = (best2[:, 0] - best2[:, 1]) > DECISIVE_MARGIN * logits.abs().amax(-1)
        hits = logits.argmax(-1).cpu() == torch.tensor(g)
        agree += int(hits[sure.cpu()].sum())
        decisive += int(sure.sum())
        total += len(g)
    return {"top1_decisive": agree / max(decisive, 1), "decisive_share": decisive / total}


def gap_tolerance(llm, max_len: int, unit: float = 2.0 ** -24) -> float:
    """The top-2 logit gap below which a batched and an alone run may pick different greedy
    tokens. Batching changes only rounding (other matmul blockings, other prefill chunk
    boundaries): a reduction of length K may round differently by up to K·u relative to the
    magnitudes it sums. A logit goes through each layer's reductions (hidden, inter, attention
    over ≤ ``max_len`` positions), and its magnitude is at most √hidden · max|final norm
    weight| · max ‖LM-head row‖ (Cauchy–Schwarz after the RMS norm), computed from the weights
    here. ``unit``: the unit roundoff of the dtype the runs compute in (float32's by default).
    Two implementations (an executor and eager PyTorch) differ the same way, by rounding only."""
    m = llm.model
    head = m.embed if m.lm_head is None else m.lm_head
    bound = m.cfg.hidden ** 0.5 * float(m.norm.abs().max()) * float(head.norm(dim=1).max())
    return unit * m.cfg.layers * (m.cfg.hidden + m.cfg.inter + max_len) * bound


def greedy(max_tokens: int, **kw):
    """Greedy decoding of exactly ``max_tokens`` tokens."""
    from mpk.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def compared_prefix(ref, out, tol: float) -> int:
    """Assert ``out``'s tokens equal those of ``ref`` (run with logprobs=2) up to the first
    position whose top-2 log-prob gap (= logit gap) in ``ref`` is below ``tol`` (that position
    may differ, and everything after it); returns the number of positions compared."""
    ref_tokens, other = ref.token_ids, out.token_ids
    n = len(ref_tokens)
    for i, lp in enumerate(ref.logprobs):
        top = sorted(lp.values(), reverse=True)
        if top[0] - top[1] < tol:
            n = i
            break
    assert other[:n] == ref_tokens[:n]
    if n == len(ref_tokens):
        assert other == ref_tokens
    return n
