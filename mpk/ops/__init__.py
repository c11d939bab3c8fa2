"""Op kinds as data (see ``registry``). Importing this package registers all of them."""

from mpk.ops import (attention, data_movement, diagnostic, iteration, linalg, paged, pointwise,  # noqa: F401  (registration)
                     rows, sampling)
from mpk.ops.registry import REGISTRY, OpDef, OpSig, get_op, op_by_type_id

__all__ = ["REGISTRY", "OpDef", "OpSig", "get_op", "op_by_type_id"]
