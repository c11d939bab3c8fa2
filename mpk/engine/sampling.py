"""``SamplingParams`` (what a request asks for) and ``sample``, which draws one token per row of
a batch of logits under each row's parameters.

Randomness is counter-based: row b's uniform number is a hash of (its seed, its counter — the
index of the token being generated), so a request with a seed gives the same tokens however it
is batched, preempted or resumed, and no generator state is carried between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from mpk.errors import BadInputError

_MASK64 = (1 << 64) - 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to pick a request's tokens and when to stop (vLLM's names and meanings).

    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it, then ``top_k``
    (0: off) keeps the k most likely tokens, ``top_p`` (1: off) the smallest set whose
    probability reaches p, ``min_p`` (0: off) the tokens at least ``min_p`` × the most likely
    one's probability, and a token is drawn from what is left, renormalised. ``max_tokens``:
    tokens to generate at most; ``stop``: strings that end the output (not included; matched
    against the text as it streams, which holds back bytes that do not yet form a character:
    a U+FFFD that ends the text appears once a later token follows it or the output ends);
    ``stop_token_ids``: token ids that end it (included in ``token_ids``, like EOS); ``ignore_eos``:
    do not stop at the model's EOS; ``seed``: per-request randomness (None: drawn from the
    engine's seed and the request's index); ``logprobs``: also return that many most likely
    tokens' log-probabilities per step (None: none). ``validate()`` raises ``BadInputError``
    naming the first bad field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def validate(self, vocab: int | None = None) -> "SamplingParams":
        """Raise ``BadInputError`` naming the first bad field (and ``vocab``, the model's, for
        ``stop_token_ids``); return self."""
        def bad(name: str, expected: str):
            raise BadInputError(f"SamplingParams.{name}={getattr(self, name)!r}; expected {expected}")

        if not _is_num(self.temperature) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "a number ≥ 0 (0: greedy)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "an int ≥ 0 (0 or -1: off)")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an int ≥ 1")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple))
                                  or not all(isinstance(s, str) and s for s in stops)):
            bad("stop", "None, a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 and (vocab is None or t < vocab) for t in self.stop_token_ids):
            bad("stop_token_ids", f"a list of token ids in [0, {vocab if vocab is not None else 'vocab'})")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            bad("seed", "None or an int in [0, 2**64)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "None or an int in [0, 20]")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints whose output bits all depend on every
    input bit."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, counter: int) -> float:
    """The uniform number in [0, 1) of (seed, counter): the top 24 bits of
    ``mix64(mix64(seed) + counter)``, so that it is exact in float32."""
    return (mix64(mix64(seed) + counter) >> 40) / float(1 << 24)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """``mix64`` of each element of a uint64 array (NumPy's uint64 products wrap mod 2**64, as
    the masks in ``mix64`` do)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: Sequence[int], counter: Sequence[int]) -> np.ndarray:
    """``uniform(seed[b], counter[b])`` for every b at once (float32 [B], equal bit for bit):
    one NumPy pass instead of a Python call per row."""
    s = np.array(seed, dtype=np.uint64)
    c = np.array(counter, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the sum wraps mod 2**64, as mix64's mask makes it
        bits = _mix64_array(_mix64_array(s) + c) >> np.uint64(40)
    return bits.astype(np.float32) / np.float32(1 << 24)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p, renormalised
    ([B, V] float32; a greedy row (temperature 0) is one-hot at its argmax, the lowest id among
    ties). Ties at a top-k or top-p boundary are all kept, so the result does not depend on
    how a sort orders equal values."""
    x = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    p = torch.softmax(x / t[:, None], dim=-1)
    V = p.shape[-1]
    srt = torch.sort(p, dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).long()
    kth = srt.gather(1, (k - 1)[:, None])  # the k-th largest probability: keep all ≥ it
    # top-p: the smallest prefix of the sorted order whose mass reaches p; keep every token at
    # least as likely as that prefix's last one. p = 1 keeps all: the float32 cumsum can reach
    # 1 before the end, which would drop the tail.
    before = torch.cumsum(srt, dim=-1) - srt
    last = (before < top_p.float()[:, None]).sum(-1, keepdim=True).clamp(1, V) - 1
    last = torch.where(top_p[:, None] >= 1, V - 1, last)
    pth = srt.gather(1, last)
    floor = torch.maximum(kth, pth)
    floor = torch.maximum(floor, min_p.float()[:, None] * srt[:, :1])
    keep = p >= floor
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum(-1, keepdim=True)
    arg = torch.argmax(x, dim=-1)  # first maximal index
    onehot = torch.nn.functional.one_hot(arg, V).to(q.dtype)
    return torch.where(greedy[:, None], onehot, q)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: Sequence[int], counter: Sequence[int]) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (int64 [B], on logits' device): row b drawn from
    ``filtered_probs``' row b by inverse CDF in token-id order at ``uniform(seed[b],
    counter[b])``. The per-row parameters are [B] tensors on logits' device (top_k int)."""
    B = logits.shape[0]
    if len(seed) != B or len(counter) != B:
        raise BadInputError(f"sample(): {len(seed)} seeds and {len(counter)} counters for {B} rows; expected {B} each")
    q = filtered_probs(logits, temperature, top_k, top_p, min_p)
    u = torch.from_numpy(uniforms(seed, counter)).to(q.device)
    cdf = torch.cumsum(q, dim=-1)
    # the first token whose cumulative mass exceeds u·total, among kept tokens (a rounding
    # shortfall of the total cannot pick a dropped tail token)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    idx = idx.clamp(max=q.shape[-1] - 1)
    last_kept = q.shape[-1] - 1 - torch.argmax((q.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(idx, last_kept).long()
