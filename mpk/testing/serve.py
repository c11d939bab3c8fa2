"""The ``LLM`` that server tests run in ``mpk serve``'s engine process: built there (the tests
pass ``functools.partial(served_llm, ...)`` to ``AsyncEngine``, which must be picklable by
reference, hence a module here), with the hooks the tests need to slow or break its steps."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mpk.engine.llm import LLM


def served_llm(model: str | os.PathLike | None, step_delay: float = 0.0, failing_steps: int = 0,
                **options: Any) -> LLM:
    """``LLM(model, **options)`` with torch on one thread (tiny steps on a shared machine only
    wait on each other with several); each step slowed by ``step_delay`` seconds (so that a
    request is surely still running when a test acts), the first ``failing_steps`` steps
    raising ``RuntimeError("device lost")``."""
    torch.set_num_threads(1)
    llm = LLM(model, **options)
    step, failures = llm.step, [failing_steps]

    def hooked_step() -> list:
        time.sleep(step_delay)
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("device lost")
        return step()
    llm.step = hooked_step
    return llm
