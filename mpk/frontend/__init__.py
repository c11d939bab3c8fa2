"""FX graph (functionalized ATen) → OpGraph: lowering rules and pattern fusion."""

from mpk.frontend.lower import find_unsupported, lower
from mpk.frontend.patterns import fuse_patterns

__all__ = ["find_unsupported", "lower", "fuse_patterns"]
