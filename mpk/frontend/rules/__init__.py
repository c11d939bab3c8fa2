"""ATen → mpk lowering rules, one module per op family; importing this package registers all of
them in ``registry.HANDLERS``."""

from mpk.frontend.rules import (attention, iteration, linalg, paged, pointwise, reductions,  # noqa: F401  (registration)
                                sampling, scatter, views)
from mpk.frontend.rules import moe  # noqa: F401  (registration)
from mpk.frontend.rules import conv  # noqa: F401  (registration)
from mpk.frontend.rules.registry import HANDLERS, lookup, no_rule_reason

__all__ = ["HANDLERS", "lookup", "no_rule_reason"]
