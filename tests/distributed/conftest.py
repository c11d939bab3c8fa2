"""Fixtures of the tensor-parallel tests: the engine tests' tiny checkpoint, and torch on one
thread in this process and in the ranks it starts (2 cores shared by up to 4 processes)."""

from __future__ import annotations

import pytest

from mpk.testing.engine import one_thread, seeded_checkpoint


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the ranks the tests start
    with one_thread():
        yield


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return seeded_checkpoint(tmp_path_factory.mktemp("tiny"))
