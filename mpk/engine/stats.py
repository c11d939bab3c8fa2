"""Summary statistics the benchmarks of the engine and the server report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """What an ``LLM`` has run: ``launches`` of the model from the host (a step, or a burst of
    decode iterations in one launch) and generated ``tokens``."""

    launches: int = 0
    tokens: int = 0

    @property
    def launches_per_token(self) -> float:
        """Host launches per generated token (NaN before any token)."""
        return self.launches / self.tokens if self.tokens else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank; NaN if empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")
