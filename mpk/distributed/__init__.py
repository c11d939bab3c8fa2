"""Tensor parallelism: the sharding pass and the ranks of a job.

The compiler's side: ``shard`` (the sharding pass over the op graph), ``binding`` (a rank's
arguments from the full model's: shards made once, communication buffers), ``symmetric`` (the
symmetric-memory protocol and its CPU simulation), ``ranks`` (the multi-rank CPU interpreter).
The job's side: ``launch`` (ranks started by torchrun or by the driver, rank 0, joined over a
store and a torch.distributed group), ``monitor`` (each rank watches the others and stops when
one dies), ``steps`` (rank 0's step inputs broadcast to the workers; the start-up agreement on
the compiled tables), ``nvshmem`` (NVSHMEM through nvshmem4py, bootstrapped from the group, and
the symmetric allocator), ``worker`` (the entry point of a rank the driver starts). The engine's
side is ``mpk.engine.parallel``; docs/architecture.md, "Tensor parallelism". Nothing here
imports nvshmem4py until NVSHMEM is initialised."""
