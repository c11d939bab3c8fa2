"""``mpk.LLM`` end to end on a tiny random float32 model (eager PyTorch steps, one test through
the CPU interpreter): batched generation equals each request alone, prefix caching, preemption,
seeded sampling, bad input, stop conditions, streaming and chat."""

from __future__ import annotations

import random

import pytest

import mpk
from mpk import LLM, SamplingParams
from mpk.errors import OptionError
from mpk.testing.decode import small_config
from mpk.testing.engine import compared_prefix, gap_tolerance, greedy

CFG = small_config("qwen3")
MAX_LEN = 512
def random_prompt(n: int) -> list[int]:
    return [random.randrange(256) for _ in range(n)]


def test_a_batch_of_64_gives_each_request_its_tokens_alone(checkpoint):
    """64 requests of random prompt lengths (1…300) and max_tokens, submitted in random order
    to an engine of 16 sequences and 64 tokens per step (prefills chunked and mixed with
    decodes), generate the greedy tokens of each request run alone, up to near-ties; the
    compared prefix covers most tokens (else the test would prove nothing)."""
    prompts = [random_prompt(random.randint(1, 300)) for _ in range(64)]
    lengths = [random.randint(1, 24) for _ in range(64)]
    order = random.sample(range(64), 64)
    llm = LLM(checkpoint, max_num_seqs=16, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    outs = llm.generate([prompts[i] for i in order], [greedy(lengths[i]) for i in order], use_tqdm=False)
    batched = {i: o for i, o in zip(order, outs)}
    alone = LLM(checkpoint, max_num_seqs=1, max_model_len=MAX_LEN, max_num_batched_tokens=320,
                enable_prefix_caching=False)
    compared, total, tol = 0, 0, gap_tolerance(alone, MAX_LEN)
    for i in range(64):
        ref = alone.generate([prompts[i]], greedy(lengths[i], logprobs=2), use_tqdm=False)[0].outputs[0]
        out = batched[i].outputs[0]
        assert batched[i].prompt_token_ids == prompts[i] and out.finish_reason == "length"
        assert len(ref.token_ids) == lengths[i]
        compared += compared_prefix(ref, out, tol)
        total += lengths[i]
    assert compared >= 0.8 * total, (compared, total, tol)
    assert llm.blocks.num_free == llm.blocks.num_pages  # every page back


def test_prefix_caching_reuses_a_shared_system_prompt(checkpoint):
    """A system prompt of 3 full pages and a part is computed once: each later request that
    starts with it takes its 3 full pages (exactly: 3 pages, 48 tokens per request), and the
    outputs equal those without prefix caching."""
    system = random_prompt(16 * 3 + random.randint(0, 15))
    firsts = random.sample(range(256), 6)  # distinct first tokens after the system prompt
    prompts = [system + [f] + random_prompt(random.randint(0, 20)) for f in firsts]
    cached = LLM(checkpoint, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64)
    outs = cached.generate(prompts[:1], greedy(8), use_tqdm=False)
    assert cached.prefix_cache_hits() == (0, 0)
    outs += cached.generate(prompts[1:], greedy(8), use_tqdm=False)
    assert cached.prefix_cache_hits() == (5 * 3, 5 * 3 * 16)
    plain = LLM(checkpoint, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64,
                enable_prefix_caching=False)
    refs = plain.generate(prompts, greedy(8, logprobs=2), use_tqdm=False)
    assert plain.prefix_cache_hits() == (0, 0)
    for ref, out in zip(refs, outs):
        compared_prefix(ref.outputs[0], out.outputs[0], gap_tolerance(plain, MAX_LEN))
    # the same prompt again: all its full pages but the one holding its last token are hit
    again = cached.generate(prompts[:1], greedy(8), use_tqdm=False)
    assert cached.prefix_cache_hits()[0] == 15 + (len(prompts[0]) - 1) // 16
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_preemption_under_a_tiny_page_pool_loses_nothing(checkpoint):
    """A pool of one sequence's pages for 8 sequences: running sequences are preempted (their
    pages freed, recomputed later), and every request still finishes with the tokens of an
    engine whose pool holds them all."""
    prompts = [random_prompt(random.randint(5, 60)) for _ in range(12)]
    params = [greedy(random.randint(10, 40)) for _ in prompts]
    small = LLM(checkpoint, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32, num_pages=128 // 16)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.num_preemptions > 0
    big = LLM(checkpoint, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32)
    refs = big.generate(prompts, [greedy(p.max_tokens, logprobs=2) for p in params], use_tqdm=False)
    assert big.num_preemptions == 0
    for ref, out, p in zip(refs, outs, params):
        assert len(out.outputs[0].token_ids) == p.max_tokens
        compared_prefix(ref.outputs[0], out.outputs[0], gap_tolerance(big, MAX_LEN))
    with pytest.raises(OptionError, match=r"num_pages=7; expected an int ≥ 8"):
        LLM(checkpoint, max_model_len=128, num_pages=7)


def test_seeded_sampling_is_reproducible(checkpoint):
    """A request with a seed draws the same tokens alone, in any batch and order, and across
    engines; requests without one draw from the engine's seed and their index: equal across two
    engines of one seed, different for another seed."""
    prompts = [random_prompt(random.randint(1, 40)) for _ in range(6)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=random.randrange(1 << 40),
                             ignore_eos=True) for _ in prompts]
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    extra = [random_prompt(30) for _ in range(3)]
    mixed = llm.generate(extra + prompts[::-1], [greedy(5)] * 3 + params[::-1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[3:]][::-1] == together
    assert [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)] == together
    assert len({tuple(t) for t in together}) > 1
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(checkpoint, max_model_len=128, seed=s).generate(
        prompts, unseeded, use_tqdm=False)] for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_bad_request_fails_alone(checkpoint):
    """An empty prompt, a prompt of max_model_len tokens, an invalid sampling value and a token
    id outside the vocabulary each fail their request (error named, finish_reason "error");
    the good requests finish."""
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    good = random_prompt(10)
    cases = [([], "empty prompt"), ("", "empty prompt"), (random_prompt(64), "prompt of 64 tokens; max_model_len=64"),
             (good, "SamplingParams.temperature=-1.0"), ([3, 260], "prompt token id 260 is outside the vocabulary"),
             (good, None)]
    params = [greedy(4)] * 3 + [SamplingParams(temperature=-1.0)] + [greedy(4)] * 2
    outs = llm.generate([c[0] for c in cases], params, use_tqdm=False)
    for (_, message), out in zip(cases, outs):
        if message is None:
            assert out.error is None and len(out.outputs[0].token_ids) == 4
        else:
            assert message in out.error and out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
    with pytest.raises(OptionError, match="tensor_parallel_size=0; expected an int ≥ 1"):
        LLM(checkpoint, tensor_parallel_size=0)
    with pytest.raises(OptionError, match="executor='tpu'"):
        LLM(checkpoint, max_model_len=64, executor="tpu")


def test_ctrl_c_stops_cleanly_and_the_engine_stays_usable(checkpoint, monkeypatch):
    """A KeyboardInterrupt in the third step leaves no sequence queued and every page free;
    the next generate gives the tokens a fresh engine gives."""
    prompts = [random_prompt(random.randint(20, 50)) for _ in range(5)]
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    execute, calls = llm.runner.execute, []

    def interrupted(rows):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return execute(rows)

    monkeypatch.setattr(llm.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(6), use_tqdm=False)
    assert not llm.scheduler.has_work() and llm.blocks.num_free == llm.blocks.num_pages
    assert all(r == 0 for r in llm.blocks.refs)
    outs = llm.generate(prompts, greedy(6, logprobs=2), use_tqdm=False)
    fresh = LLM(checkpoint, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    for ref, out in zip(fresh.generate(prompts, greedy(6, logprobs=2), use_tqdm=False), outs):
        compared_prefix(ref.outputs[0], out.outputs[0], gap_tolerance(fresh, MAX_LEN))


def test_stop_conditions_and_finish_reasons(checkpoint):
    """max_tokens and max_model_len end with "length"; a stop token id, EOS (unless ignore_eos)
    and a stop string with "stop": a stop id or EOS included in the tokens, a stop string cut
    from the text."""
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=48, max_num_batched_tokens=32)
    prompt = random_prompt(8)
    full = llm.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    longest = llm.generate([prompt], greedy(100), use_tqdm=False)[0].outputs[0]
    assert longest.finish_reason == "length" and len(longest.token_ids) == 48 - 8
    assert longest.token_ids[:30] == full.token_ids
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([prompt], greedy(30, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop_id, full.token_ids[:first + 1])
    llm.eos_ids = frozenset({stop_id})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", None, full.token_ids[:first + 1])
    assert llm.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0].token_ids == full.token_ids  # ignore_eos
    text = full.text
    stop = next(c for c in text[3:] if c != "\ufffd")
    out = llm.generate([prompt], greedy(30, stop=["never there", stop]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text[:text.index(stop)])
    # generation ends at the first token whose text completes the stop string (the last one,
    # where the string first shows in the last token's text)
    ends = next(k for k in range(1, 31) if stop in llm.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True))
    assert out.token_ids == full.token_ids[:ends]


def test_stream_yields_what_generate_returns(checkpoint):
    """Streamed pieces (text held back while it could begin a stop string) concatenate to
    generate's text and tokens, the last piece marked finished; chat goes through the chat
    template."""
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    prompts = ["hello mpk", "a longer prompt, so that it takes two steps"]
    full = llm.generate(prompts, greedy(20), use_tqdm=False)
    stop = next(c for c in full[0].outputs[0].text[4:] if c != "\ufffd")
    params = greedy(20, stop=[stop + "\ufffd\ufffd", stop])
    want = llm.generate(prompts, params, use_tqdm=False)
    got = {0: ["", []], 1: ["", []]}
    last = {}
    for piece in llm.stream(prompts, params):
        i = piece.request_id - want[0].request_id - 2
        got[i][0] += piece.outputs[0].text
        got[i][1] += piece.outputs[0].token_ids
        last[i] = piece
    for i, w in enumerate(want):
        assert got[i] == [w.outputs[0].text, w.outputs[0].token_ids] and last[i].finished
        assert last[i].outputs[0].finish_reason == w.outputs[0].finish_reason
    conv = [{"role": "user", "content": "hi there"}]
    out = llm.chat(conv, greedy(5), use_tqdm=False)[0]
    assert out.prompt == "<|user|>hi there\n<|assistant|>"
    assert out.prompt_token_ids == [258] + list(b"hi there\n") + [259]
    assert llm.generate([out.prompt_token_ids], greedy(5), use_tqdm=False)[0].outputs[0].token_ids == \
        out.outputs[0].token_ids


def test_the_cpu_interpreter_executor_agrees_with_eager(checkpoint):
    """The steps compiled by mpk (CPU interpreter: buckets 1, 2, 4 and the decode form of 2
    sequences) generate eager PyTorch's greedy tokens, up to near-ties."""
    prompts = [random_prompt(5), random_prompt(3)]
    kw = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=4, page_size=4)
    compiled = LLM(checkpoint, executor="cpu", **kw)
    outs = compiled.generate(prompts, greedy(4), use_tqdm=False)
    assert compiled.runner.buckets.report is not None and set(compiled.runner.buckets.report.trace_s) == {
        "T=1", "T=2", "T=4", "decode"}
    eager = LLM(checkpoint, **kw)
    refs = eager.generate(prompts, greedy(4, logprobs=2), use_tqdm=False)
    for ref, out in zip(refs, outs):
        compared_prefix(ref.outputs[0], out.outputs[0], gap_tolerance(eager, MAX_LEN))


def test_mpk_exports_the_engine_lazily():
    assert mpk.LLM is LLM and mpk.SamplingParams is SamplingParams and mpk.RequestOutput.__name__ == "RequestOutput"
    with pytest.raises(AttributeError):
        mpk.NoSuchThing  # noqa: B018


def test_compile_makes_every_graph_once_before_the_first_request(checkpoint):
    """``LLM.compile()`` traces the token buckets and the decode form up front (a server calls
    it before taking requests); later steps and later calls reuse them."""
    llm = LLM(checkpoint, executor="cpu", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16)
    assert llm.runner.buckets.report is None
    report = llm.compile()
    assert llm.compile() is report and llm.runner.buckets.report is report
    assert {"decode"} | {f"T={t}" for t in llm.runner.buckets.buckets} <= {k.split(" ")[0] for k in report.trace_s}
    out = llm.generate([random_prompt(5)], greedy(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and llm.runner.buckets.report is report
