"""Tensor parallelism (planned): the sharding pass over the op graph and NVSHMEM bootstrapped
through torch.distributed. Empty until that lands."""
