"""Tensor parallelism: the sharding pass over the op graph (``shard``), symmetric memory
(``symmetric``: the protocol and its CPU simulation), the multi-rank CPU interpreter (``ranks``)
and NVSHMEM bootstrapped through torch.distributed; docs/architecture.md, "Tensor parallelism"."""
