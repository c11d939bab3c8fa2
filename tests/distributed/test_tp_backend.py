"""torch.compile(..., options={"tensor_parallel": (rank, world)}): the backend shards the graph;
degree 1 runs its collectives in the one interpreter and matches eager."""

import pytest
import torch

from mpk import backend
from mpk.errors import NotSupportedError
from mpk.llm.kv_cache import PagedKVCache
from mpk.llm.model import DecoderLM
from mpk.testing.decode import small_config
from mpk.testing.graphs import relative_error
from mpk.testing.tp import tp_logits_bound


def _model_and_args(seed: int):
    m = DecoderLM(small_config("llama", vocab=96), torch.float32, max_len=32).randomize(seed, scale=0.1)
    cache = PagedKVCache(m, 2, 32, 8)
    cache.grow([4, 2])
    return m, cache, (torch.randint(0, 96, (6,)), *cache.args(), cache.qo_indptr)


def test_degree_one_runs_the_collectives_and_matches_eager():
    m, cache, args = _model_and_args(int(torch.randint(0, 1 << 20, ())))
    with torch.no_grad():
        eager_cache = cache.cache.clone()
        eager = m(args[0], eager_cache, *args[2:])
        step = torch.compile(m, backend="mpk", fullgraph=True,
                             options={"executor": "cpu", "num_workers": 8, "tensor_parallel": (0, 1)})
        out = step(*args)
    kinds = [op.kind for op in backend.COMPILED[-1].graph.ops]
    assert kinds.count("all_reduce") == 1 + 2 * m.cfg.layers and kinds.count("all_gather") == 1
    assert kinds.count("comm_put") == 2 + 2 * m.cfg.layers
    bound = tp_logits_bound(m.cfg, 4, 1)
    assert relative_error(out, eager) <= bound
    assert relative_error(cache.cache, eager_cache) <= bound


def test_cpu_executor_runs_one_rank_only():
    m, _, args = _model_and_args(0)
    step = torch.compile(m, backend="mpk", fullgraph=True,
                         options={"executor": "cpu", "num_workers": 8, "tensor_parallel": (0, 2)})
    with torch.no_grad(), pytest.raises(Exception) as e:
        step(*args)
    err = e.value  # Dynamo wraps a backend's error (BackendCompilerFailed): find ours in the chain
    while not isinstance(err, NotSupportedError) and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    assert isinstance(err, NotSupportedError) and "run_ranks" in str(err)


def test_the_ranks_of_one_job_agree_on_the_rank_free_digest():
    """The start-up agreement's digest: equal for the ranks of one job (whose tables differ only
    in what names the rank), different for another degree or another graph."""
    from mpk.compiler import compile_graph
    from mpk.distributed.shard import shard_graph
    from mpk.testing.tp import traced_step

    step = traced_step("qwen3", False, 0, [5, 9])
    other = traced_step("qwen3", True, 0, [5, 9], [2, 3])

    def tables(traced, rank: int, world: int):
        sharded = shard_graph(traced.compiled.graph, rank, world)
        return compile_graph(sharded.graph, 8, options={"tensor_parallel": [rank, world]}).tables

    ranks = [tables(step, r, 2) for r in range(2)]
    assert ranks[0].digest() != ranks[1].digest()
    assert ranks[0].rank_free_digest() == ranks[1].rank_free_digest()
    assert tables(step, 0, 4).rank_free_digest() != ranks[0].rank_free_digest()
    assert tables(other, 0, 2).rank_free_digest() != ranks[0].rank_free_digest()


def test_torch_compiles_ranks_agree_on_the_rank_free_digest():
    """Through torch.compile for the GPU (traced only; what the engine's ranks compare at
    start-up): the tables carry
    the tensor_parallel option, so the ranks of one job agree and another degree differs."""
    m, _, args = _model_and_args(0)

    def digest(rank: int, world: int) -> str:
        torch._dynamo.reset()
        step = torch.compile(m, backend="mpk", fullgraph=True,
                             options={"executor": "gpu", "num_workers": 8, "tensor_parallel": (rank, world)})
        with torch.no_grad(), backend.trace_only(), pytest.raises(backend.TracedOnly) as e:
            step(*args)
        return e.value.compiled.tables.rank_free_digest()

    ranks = [digest(r, 2) for r in range(2)]
    assert ranks[0] == ranks[1] != digest(0, 4)
