"""What lowering rules return besides ``View``s, and the exception a rule raises when it cannot
lower a node."""

from __future__ import annotations

from dataclasses import dataclass


class Unsupported(Exception):
    """Raised by a handler: this node (with these arguments) cannot be lowered; says why."""


@dataclass(frozen=True)
class Unavailable:
    """A secondary output mpk does not compute (e.g. the mean of ``native_layer_norm``)."""

    what: str


@dataclass(frozen=True)
class ScalarConst(Unavailable):
    """A 0-d tensor made inside forward from a number (``aten.scalar_tensor``, what
    ``torch.where(c, x, 0.0)`` traces to): elementwise ops take it as a constant, nothing else
    does."""

    value: int | float | bool = 0


def refuse_unavailable(values, takes_scalars: bool = False) -> None:
    """Raise ``Unsupported`` for the first value mpk does not compute (a ScalarConst is one
    unless ``takes_scalars``)."""
    for v in values:
        if isinstance(v, Unavailable) and not (takes_scalars and isinstance(v, ScalarConst)):
            raise Unsupported(f"it consumes {v.what}, which mpk does not compute")
