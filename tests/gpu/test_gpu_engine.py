"""``mpk.LLM`` on the GPU executor (marker ``gpu``; skipped without CUDA): the engine's steps as
megakernel launches pick the model's greedy tokens (teacher-forced against its float32 twin)
for a batch of requests whose prefills are chunked and mixed with decodes, and for the default
model's text."""

from __future__ import annotations

import random

import pytest
import torch

from mpk import LLM
from mpk.errors import MpkError
from mpk.llm.default_model import default_model_path
from mpk.testing.engine import greedy, seeded_checkpoint, teacher_forced_agreement

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # the GPU's paged attention tasks take head dims of multiples of 64
    return seeded_checkpoint(tmp_path_factory.mktemp("tiny"), hidden=256, inter=512, head_dim=64)


def test_gpu_steps_give_the_models_greedy_tokens(checkpoint):
    """12 requests of random lengths through 4 sequences and 32-token steps (chunked prefills
    beside decodes, buckets 1…32 and the decode graph), bf16: teacher-forced, the tokens the
    megakernel engine picked are the float32 model's greedy choice wherever it is decisive
    (≥ 99%), as the eager bf16 engine's are; every page comes back."""
    prompts = [[random.randrange(256) for _ in range(random.randint(1, 80))] for _ in range(12)]
    kw = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, dtype=torch.bfloat16)
    gpu = LLM(checkpoint, executor="gpu", **kw)
    outs = [o.outputs[0].token_ids for o in gpu.generate(prompts, greedy(12), use_tqdm=False)]
    eager = LLM(checkpoint, executor="eager", **kw)
    refs = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(12), use_tqdm=False)]
    mine, theirs = teacher_forced_agreement(gpu.model, prompts, outs), teacher_forced_agreement(eager.model, prompts, refs)
    assert mine["decisive_share"] >= 0.25, mine  # else the check decided little
    assert mine["top1_decisive"] >= 0.99 and theirs["top1_decisive"] >= 0.99, (mine, theirs)
    assert gpu.blocks.num_free == gpu.blocks.num_pages


def test_default_model_text_on_the_gpu_executor():
    """The default model's greedy continuation of a prompt on the megakernel (bf16): text, and
    every token the float32 model is decisive about is its choice (teacher-forced)."""
    try:
        default_model_path()
    except MpkError as e:
        pytest.skip(str(e))
    kw = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64, dtype=torch.bfloat16)
    gpu = LLM(None, executor="gpu", **kw)
    out = gpu.generate(["The capital of France is"], greedy(16), use_tqdm=False)[0]
    stats = teacher_forced_agreement(gpu.model, [out.prompt_token_ids], [out.outputs[0].token_ids])
    assert out.outputs[0].text.strip() and stats["top1_decisive"] == 1.0, (out.outputs[0].text, stats)
