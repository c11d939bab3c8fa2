"""The engine step's host side: ``uniforms`` equals ``uniform`` bit for bit, greedy rows take the
argmax ``sample`` would give them (mixed with sampled rows, whose tokens do not depend on the
batch), logprobs in one copy, and the incremental detokenizer's stream equals a full decode."""

from __future__ import annotations

import random

import torch

from mpk import LLM, SamplingParams
from mpk.engine.detokenizer import IncrementalDetokenizer
from mpk.engine.sampling import sample, uniform, uniforms
from mpk.llm import DecoderLM
from mpk.testing.decode import small_config
from mpk.testing.engine import VOCAB, byte_tokenizer


def test_uniforms_equal_uniform_bit_for_bit():
    top = (1 << 64) - 1
    seeds = [random.getrandbits(64) for _ in range(2000)] + [0, 1, top, top - 1]
    counters = [random.getrandbits(random.choice([1, 16, 40, 63, 64])) for _ in seeds[:-4]] + [top, 0, top, 1]
    got = uniforms(seeds, counters)
    assert got.dtype.name == "float32"
    assert [float(u) for u in got] == [uniform(s, c) for s, c in zip(seeds, counters)]


def test_greedy_rows_take_the_argmax_sample_gives_them():
    logits = torch.randn(6, 300)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the lowest id
    zeros = torch.zeros(6)
    ref = sample(logits, zeros, zeros.long(), torch.ones(6), zeros, list(range(6)), [3] * 6)
    assert torch.equal(torch.argmax(logits, dim=-1), ref) and ref[2] == 7


def _engine(tokenizer=None) -> LLM:
    cfg = small_config("qwen3", vocab=VOCAB)
    model = DecoderLM(cfg, torch.float32, "cpu", max_len=128).randomize(seed=3, scale=0.3)
    return LLM.from_model(model, tokenizer, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64)


def test_mixed_greedy_and_sampled_rows_each_get_their_tokens_alone():
    llm = _engine()
    prompts = [[random.randrange(256) for _ in range(random.randint(1, 9))] for _ in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=20 * (i % 3), max_tokens=12, ignore_eos=True,
                             seed=i, logprobs=i % 3 if i < 4 else None) for i in range(6)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for p, q, b in zip(prompts, params, batched):
        alone = llm.generate([p], q, use_tqdm=False)[0].outputs[0]
        assert b.outputs[0].token_ids == alone.token_ids
        if q.logprobs is not None:
            for tok, lp in zip(alone.token_ids, alone.logprobs):
                assert tok in lp and len(lp) >= q.logprobs


def test_from_model_without_a_tokenizer_takes_token_ids_only():
    llm = _engine()
    out = llm.generate([[1, 2, 3], "text", [4]], [SamplingParams(temperature=0, max_tokens=3),
                                                 SamplingParams(max_tokens=3),
                                                 SamplingParams(stop="x", max_tokens=3)], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    assert "needs a tokenizer" in out[1].error and "stop='x' needs a tokenizer" in out[2].error


def test_the_detokenizer_stream_equals_a_full_decode():
    tok = byte_tokenizer()
    for _ in range(100):
        ids = [random.randrange(VOCAB) for _ in range(random.randint(1, 40))]
        inc = IncrementalDetokenizer(tok)
        text = "".join(inc.step(ids[:n]) for n in range(1, len(ids) + 1)) + inc.flush(ids)
        assert text == tok.decode(ids, skip_special_tokens=True)
