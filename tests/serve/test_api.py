"""The OpenAI API through the official client against a server over a tiny random model:
completions and chat equal the offline engine's output, streams reassemble to the whole
response, usage, logprobs, stop strings, seeds, and 32 concurrent streams."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from mpk import LLM, SamplingParams

from .conftest import MAX_LEN, MODEL

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(checkpoint) -> LLM:
    """An offline engine over the server's model (the server's own is in its engine process)."""
    return LLM(checkpoint, max_num_seqs=8, max_model_len=MAX_LEN)


def offline(llm: LLM, prompt, chat: bool = False, **params) -> str:
    """The greedy text ``llm`` generates offline."""
    p = SamplingParams(temperature=0, ignore_eos=True, **params)
    out = llm.chat([prompt], p, use_tqdm=False) if chat else llm.generate([prompt], p, use_tqdm=False)
    return out[0].outputs[0].text


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_equals_the_engine_and_counts_usage(client, reference):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, **GREEDY)
    choice = out.choices[0]
    assert choice.text == offline(reference, "The quick brown fox", max_tokens=12)
    assert choice.finish_reason == "length"
    prompt_tokens = len(reference.tokenizer("The quick brown fox")["input_ids"])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (prompt_tokens, 12, prompt_tokens + 12)
    ids = [random.randrange(256) for _ in range(20)]  # a prompt of token ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.usage.prompt_tokens == 20 and by_ids.choices[0].text == offline(reference, ids, max_tokens=5)


def test_chat_applies_the_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline(reference, messages, chat=True, max_tokens=10)
    assert out.usage.prompt_tokens == len(reference.chat_prompt(messages)[1])
    assert out.usage.completion_tokens == 10


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_reassembles_to_the_whole_response(client, chat):
    kw = dict(model=MODEL, max_tokens=20, **GREEDY)
    if chat:
        kw["messages"] = [{"role": "user", "content": "Tell me a story"}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = "Once upon a time"
        create = client.completions.create
    whole = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20  # include_usage: a last chunk of usage
    if chat:
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in body)
        assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len(body) > 2  # it did stream


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3
        assert value == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_stop_string_and_seed(client):
    # a stop string the greedy text holds: the output ends before its first occurrence. Made of
    # complete characters: bytes that never form one (U+FFFD, common in a random model's
    # byte-level text) are held back while they end the text, so a stop string of them matches
    # late or never. One prompt's text may be nothing else: try a few.
    for prompt in ("stop here", "The end", "halt 123", "cease, now", "0 1 2 3"):
        text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
        clean = [i for i in range(len(text) - 1) if "\ufffd" not in text[i:i + 2]]
        if clean:
            break
    assert clean, "five prompts' greedy texts hold no two complete characters in a row"
    stop = text[clean[len(clean) // 2]:][:2]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].text == text[:text.find(stop)] and out.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=MODEL, prompt="dice", max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
               .choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_32_concurrent_streams_finish_with_their_lengths(server):
    async def run() -> list[tuple[int, int, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i: int, n: int) -> tuple[int, int, str]:
            stream = await client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=n, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY)
            usage, reason = None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            return n, usage, reason

        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(i, random.randint(1, 24)) for i in range(32))), 120)

    results = asyncio.run(run())
    assert len(results) == 32
    assert all(usage == n and reason == "length" for n, usage, reason in results), results
    server.wait_for("mpk_kv_pages_in_use", 0)
