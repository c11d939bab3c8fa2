"""Fixtures of the engine tests: tiny random checkpoints (built once per session, seeded from
the run's MPK_TEST_SEED), and torch on one thread (these steps are tiny: with several threads
on a shared machine they wait on each other, 10-50× slower)."""

from __future__ import annotations

import pytest

from mpk.testing.engine import one_thread, seeded_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return seeded_checkpoint(tmp_path_factory.mktemp("tiny"))
