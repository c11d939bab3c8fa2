"""``mpk.LLM`` on the GPU executor (marker ``gpu``; skipped without CUDA): the engine's steps as
megakernel launches give eager PyTorch's greedy tokens (on the same device and dtype) up to
near-ties, for a batch of requests whose prefills are chunked and mixed with decodes, and for
the default model's text."""

from __future__ import annotations

import random

import pytest
import torch

from mpk import LLM
from mpk.errors import MpkError
from mpk.llm.default_model import default_model_path
from mpk.testing.engine import compared_prefix, gap_tolerance, greedy, seeded_checkpoint

pytestmark = pytest.mark.gpu
BF16_UNIT = 2.0 ** -8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # the GPU's paged attention tasks take head dims of multiples of 64
    return seeded_checkpoint(tmp_path_factory.mktemp("tiny"), hidden=256, inter=512, head_dim=64)


def test_gpu_steps_give_eager_greedy_tokens(checkpoint):
    """12 requests of random lengths through 4 sequences and 32-token steps (chunked prefills
    beside decodes, buckets 1…32 and the decode graph), bf16, against the eager engine."""
    prompts = [[random.randrange(256) for _ in range(random.randint(1, 80))] for _ in range(12)]
    kw = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, dtype=torch.bfloat16)
    gpu = LLM(checkpoint, executor="gpu", **kw)
    outs = gpu.generate(prompts, greedy(12), use_tqdm=False)
    eager = LLM(checkpoint, executor="eager", **kw)
    refs = eager.generate(prompts, greedy(12, logprobs=2), use_tqdm=False)
    tol = gap_tolerance(eager, 128, BF16_UNIT)
    compared = sum(compared_prefix(r.outputs[0], o.outputs[0], tol) for r, o in zip(refs, outs))
    assert compared >= 0.5 * 12 * 12, compared  # else near-ties decided nothing and the test proved little
    assert gpu.blocks.num_free == gpu.blocks.num_pages


def test_default_model_text_on_the_gpu_executor():
    """The default model's greedy continuation of a prompt, megakernel against eager (bf16)."""
    try:
        default_model_path()
    except MpkError as e:
        pytest.skip(str(e))
    kw = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64, dtype=torch.bfloat16)
    gpu, eager = LLM(None, executor="gpu", **kw), LLM(None, executor="eager", **kw)
    prompt = "The capital of France is"
    ref = eager.generate([prompt], greedy(16, logprobs=2), use_tqdm=False)[0].outputs[0]
    out = gpu.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0]
    assert compared_prefix(ref, out, gap_tolerance(eager, 256, BF16_UNIT)) >= 1
