"""Tensor parallelism: the ranks of a job and how they talk.

``launch``: ranks started by torchrun or by the driver (rank 0), joined over a store and a
torch.distributed group; ``monitor``: each rank watches the others and stops when one dies;
``steps``: rank 0's step inputs broadcast to the workers and the start-up agreement on the
compiled tables; ``nvshmem``: NVSHMEM through nvshmem4py, bootstrapped from the group, and the
symmetric allocator of the communication buffers; ``worker``: the entry point of a rank the
driver starts. The engine's side is ``mpk.engine.parallel``. Nothing here imports nvshmem4py
until NVSHMEM is initialised."""
