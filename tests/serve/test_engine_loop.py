"""The engine primitives the server runs on (``LLM.add_request``, ``step``, ``abort``) and the
engine process's handling of a failing step."""

from __future__ import annotations

import httpx

from mpk import LLM, SamplingParams

from .conftest import MAX_LEN, MODEL, serving


def test_step_deltas_reassemble_and_abort_frees_pages(checkpoint):
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole = llm.generate(["abc", "defg"], params, use_tqdm=False)
    first = [llm.add_request(p, params) for p in ("abc", "defg")]
    doomed = llm.add_request("x" * 50, SamplingParams(max_tokens=100, ignore_eos=True))
    bad = llm.add_request([], params)
    assert bad.finished and "empty prompt" in bad.error and not any(o.finished for o in first)
    text = {o.request_id: "" for o in first}
    tokens = {o.request_id: [] for o in first}
    steps = 0
    while llm.has_unfinished():
        if steps == 3:  # all three running
            assert llm.blocks.num_free < llm.blocks.num_pages
            assert llm.abort(doomed.request_id) and not llm.abort(doomed.request_id)  # gone the first time
        for out in llm.step():
            if out.request_id != doomed.request_id:
                text[out.request_id] += out.outputs[0].text
                tokens[out.request_id] += out.outputs[0].token_ids
            else:
                assert steps < 3
        steps += 1
    assert list(text.values()) == [w.outputs[0].text for w in whole]
    assert list(tokens.values()) == [w.outputs[0].token_ids for w in whole]
    assert llm.blocks.num_free == llm.blocks.num_pages  # every page back, the aborted one's too


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(checkpoint):
    with serving(checkpoint, failing_steps=1, max_num_seqs=4) as server:  # its first step: "device lost"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        m = server.metrics()
        assert m["mpk_requests_finished_total{error}"] == 1 and m["mpk_kv_pages_in_use"] == 0
