"""Op kinds as data (see ``registry``). Importing this package registers all of them."""

from mpk.ops import (attention, collective, data_movement, diagnostic, iteration, linalg, moe,  # noqa: F401
                     paged, pointwise, rows, sampling)  # (registration)
from mpk.ops.registry import REGISTRY, OpDef, OpSig, get_op, op_by_type_id

__all__ = ["REGISTRY", "OpDef", "OpSig", "get_op", "op_by_type_id"]
