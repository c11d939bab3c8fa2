"""Fixtures of the engine tests: tiny random checkpoints (built once per session, seeded from
the run's MPK_TEST_SEED), and torch on one thread (these steps are tiny: with several threads
on a shared machine they wait on each other, 10-50× slower)."""

from __future__ import annotations

import os

import pytest
import torch

from mpk.testing.decode import small_config
from mpk.testing.engine import VOCAB, tiny_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3 (2 layers, hidden 64, qk-norm) with the byte tokenizer, as a HF
    directory."""
    seed = int(os.environ["MPK_TEST_SEED"])
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), small_config("qwen3", vocab=VOCAB), seed)
