"""``mpk.LLM(decode_iterations=k)``: bursts of decode iterations in one launch (eager steps on the
CPU) give the greedy tokens of single steps for requests of random lengths and arrival order,
stop at stop tokens and stop strings mid-burst as steps do, survive a tiny page pool (free list
dry, preemption), free every page, report fewer launches per token, and refuse bad values."""

from __future__ import annotations

import random

import pytest

from mpk import LLM, SamplingParams
from mpk.engine.llm import BURST, default_decode_iterations
from mpk.errors import OptionError
from mpk.testing.engine import compared_prefix, gap_tolerance, greedy

MAX_LEN = 128
KW = dict(max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=64)


def random_prompt(n: int) -> list[int]:
    return [random.randrange(256) for _ in range(n)]


def _check(checkpoint, prompts, params, k: int, **kw) -> tuple[LLM, LLM, list]:
    """Run ``prompts`` through an engine of ``k`` decode iterations per launch and one of single
    steps (its logprobs give the near-ties); assert equal tokens up to near-ties (most of them
    compared) and every page freed; returns the engines and the burst engine's outputs."""
    burst = LLM(checkpoint, decode_iterations=k, **(KW | kw))
    outs = burst.generate(prompts, params, use_tqdm=False)
    step = LLM(checkpoint, **(KW | kw))
    refs = step.generate(prompts, [SamplingParams(**{**vars(p), "logprobs": 2}) for p in params], use_tqdm=False)
    tol = gap_tolerance(step, MAX_LEN)
    compared = sum(compared_prefix(r.outputs[0], o.outputs[0], tol) for r, o in zip(refs, outs))
    assert compared >= 0.8 * sum(len(r.outputs[0].token_ids) for r in refs), compared
    for r, o in zip(refs, outs):
        if r.outputs[0].token_ids == o.outputs[0].token_ids:
            assert (o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) == \
                   (r.outputs[0].text, r.outputs[0].finish_reason, r.outputs[0].stop_reason)
    assert burst.blocks.num_free == burst.blocks.num_pages
    return burst, step, outs


def test_bursts_give_the_greedy_tokens_of_single_steps(checkpoint):
    """16 requests of random prompt lengths and max_tokens, in random order, through 8
    sequences: bursts of 4 iterations (padded to the batch sizes 1, 2, 4, 8 as sequences finish)
    give the tokens of single steps, with fewer launches per token."""
    prompts = [random_prompt(random.randint(1, 60)) for _ in range(16)]
    params = [greedy(random.randint(1, 40)) for _ in range(16)]
    order = random.sample(range(16), 16)
    burst, step, outs = _check(checkpoint, [prompts[i] for i in order], [params[i] for i in order], 4)
    assert all(len(o.outputs[0].token_ids) == params[i].max_tokens for i, o in zip(order, outs))
    assert burst.stats().tokens == step.stats().tokens == sum(p.max_tokens for p in params)
    assert burst.stats().launches_per_token < 0.7 * step.stats().launches_per_token, (burst.stats(), step.stats())


def test_stop_tokens_and_strings_end_a_burst_where_steps_end(checkpoint):
    """Stop token ids and stop strings met in the middle of a burst (picked from a first run's
    output) end the request there, as single steps do; max_model_len ends one too."""
    texts = ["".join(chr(random.randrange(97, 123)) for _ in range(random.randint(3, 30))) for _ in range(6)]
    free = LLM(checkpoint, **KW).generate(texts, greedy(24), use_tqdm=False)
    params = []
    for i, o in enumerate(free):
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        if i % 3 == 0:
            params.append(greedy(24, stop_token_ids=[ids[random.randint(3, 12)]]))
        elif i % 3 == 1 and len(text) > 8:
            params.append(greedy(24, stop=[text[5:8]]))
        else:
            params.append(greedy(24))
    texts.append("x" * (MAX_LEN - 10))  # reaches max_model_len mid-burst
    params.append(greedy(24))
    _, _, outs = _check(checkpoint, texts, params, 8)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons[0] == "stop" and outs[0].outputs[0].stop_reason == params[0].stop_token_ids[0]
    assert reasons[-1] == "length" and len(outs[-1].prompt_token_ids) + len(outs[-1].outputs[0].token_ids) == MAX_LEN


def test_a_tiny_page_pool_loses_nothing(checkpoint):
    """A pool of 10 pages for 8 sequences: bursts run their free lists dry (rows stop early and
    resume), sequences are preempted between launches, and every request still gets the tokens
    of single steps; every page comes back."""
    prompts = [random_prompt(random.randint(5, 40)) for _ in range(10)]
    params = [greedy(random.randint(10, 40)) for _ in prompts]
    burst, _, outs = _check(checkpoint, prompts, params, 8, num_pages=10)
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params))
    assert burst.num_preemptions > 0


def test_seeded_sampling_in_bursts_reproduces(checkpoint):
    """Sampled and greedy requests in one burst: two engines give the same tokens bit for bit."""
    prompts = [random_prompt(random.randint(1, 30)) for _ in range(5)]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=16, seed=random.randrange(1 << 40),
                             ignore_eos=True) for _ in range(4)] + [greedy(16)]
    runs = [[o.outputs[0].token_ids for o in LLM(checkpoint, decode_iterations=6, **KW).generate(
        prompts, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 16 for t in runs[0])
    assert len({tuple(t) for t in runs[0]}) > 1


@pytest.mark.parametrize("k", [0, -2, 2.5, "4", True])
def test_bad_decode_iterations_raise(checkpoint, k):
    with pytest.raises(OptionError, match=f"decode_iterations={k!r}; expected an int ≥ 1"):
        LLM(checkpoint, decode_iterations=k, **KW)


def test_bursts_are_the_default_on_one_gpu_only(checkpoint):
    """No ``decode_iterations``: bursts of BURST on the GPU executor of one GPU, single steps
    on the CPU executors and under tensor parallelism (whose step graph is one GPU's)."""
    assert [default_decode_iterations(e, tp) for e, tp in (("gpu", 1), ("gpu", 2), ("cpu", 1), ("eager", 1))] \
        == [BURST, 1, 1, 1] and BURST > 1
    assert LLM(checkpoint, executor="eager", **KW).runner.decode_iterations == 1
