"""Op kinds as data (see ``registry``). Importing this package registers all of them."""

from mpk.ops import (attention, collective, data_movement, diagnostic, iteration, linalg, paged,  # noqa: F401
                     pointwise, rows, sampling)  # (registration)
from mpk.ops import moe  # noqa: F401  (registration)
from mpk.ops import conv, spatial  # noqa: F401  (registration)
from mpk.ops import splitk  # noqa: F401  (registration)
from mpk.ops.registry import REGISTRY, OpDef, OpSig, get_op, op_by_type_id

__all__ = ["REGISTRY", "OpDef", "OpSig", "get_op", "op_by_type_id"]
