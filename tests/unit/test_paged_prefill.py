"""The ragged form of the paged ops (``qo_indptr``: prefill, chunked prefill, mixed batches;
mpk.ops.paged documents it) on the CPU: eager and compiled through torch.compile on the CPU
executor against float64 references computed position by position through the page list
(mpk.testing.ragged: the references, and the tolerances derived from the roundings), the
happens-before check over the cross-row order, the CUDA side's table checks and builds, and the
errors of bad tables."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.compiler.verify import verify
from mpk.errors import BadInputError, VerifyError
from mpk.frontend.fused_ops import paged_attention, rope_append
from mpk.ops import registry
from mpk.ops.paged import DECODE_ROWS, MIN_CHUNK, MMA_ROWS, attention_plan, block_costs, plan_items, rows_per_tile
from mpk.testing.graphs import relative_error
from mpk.testing.ragged import (
    EPS,
    RaggedBatch,
    RaggedCase,
    check_ragged,
    dense_ragged_attention,
    ragged_batch,
    ragged_step,
    random_case,
)
from mpk.testing.tolerance import attention_bound

PROMPTS = [1, 7, 16, 17, 300]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(random.randrange(1 << 30))


def _eager(case: RaggedCase, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache = case.cache.clone()
    q, out = ragged_step(case, splits)(*case.args(cache))
    return q, out, cache


# G = 1, 2, 4, 8; head dims 64 and 128 (Qwen-like 32/8 and 64/8 groups at 128)
GROUPS = [(4, 4, 64), (8, 4, 64), (8, 2, 128), (16, 2, 128), (16, 2, 64)]


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GROUPS, ids=lambda x: str(x))
def test_prefill_matches_dense(page_size, heads, kv_heads, head_dim):
    """Fresh prompts of 1, 7, 16, 17 and 300 rows and two padding rows, qk-norm on and off,
    one chunk and several: q, the appended k/v and attention against float64."""
    g = _gen()
    case = random_case(ragged_batch([0] * len(PROMPTS), PROMPTS, page_size, g, padding=2), heads, kv_heads, head_dim,
                 qk_norm=heads % 16 != 0, g=g)
    for splits in (1, 3):
        check_ragged(case, *_eager(case, splits))


# prefill chunks over cached prefixes, decodes (one row), an idle sequence (no rows), one whose
# prefix ends on a page boundary, and padding rows
MIXED_PREFIX, MIXED_NEW = [40, 300, 0, 5, 17, 64, 33], [17, 64, 16, 1, 1, 0, 31]


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_matches_dense(page_size, group):
    g = _gen()
    case = random_case(ragged_batch(MIXED_PREFIX, MIXED_NEW, page_size, g, padding=3), 2 * group, 2, 64,
                 qk_norm=group % 2 == 0, g=g)
    check_ragged(case, *_eager(case, 4))


def test_bf16_mixed_batch_matches_dense():
    g = _gen()
    case = random_case(ragged_batch(MIXED_PREFIX, MIXED_NEW, 16, g, padding=3), 8, 2, 128, qk_norm=True, g=g,
                 dtype=torch.bfloat16)
    check_ragged(case, *_eager(case, 2))


def test_chunked_prefill_matches_the_whole_prompt():
    """A prompt of 300 rows run in chunks of 64 (the page table grown by each chunk before its
    step) against the whole prompt in one step: the same cache bit for bit (each row's k/v
    depends on that row alone) and each row's output within the bound of the float64
    reference, as the whole prompt's is."""
    g = _gen()
    n, chunk, page_size = 300, 64, 16
    whole = random_case(ragged_batch([0], [n], page_size, g, spare=0), 8, 2, 128, qk_norm=True, g=g)
    _, out_whole, cache_whole = _eager(whole, 2)
    cache = whole.cache.clone()
    pages = whole.batch.pages[0]
    outs = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        used = -(-(start + m) // page_size)
        step_batch = RaggedBatch([start + m], [m], m, page_size, [pages[:used]],
                                 torch.tensor([0, used], dtype=torch.int32),
                                 torch.tensor(pages[:used], dtype=torch.int32),
                                 torch.tensor([(start + m - 1) % page_size + 1], dtype=torch.int32),
                                 torch.tensor([0, m], dtype=torch.int32), whole.batch.num_pages)
        part = dataclasses.replace(whole, batch=step_batch, qkv=whole.qkv[start:start + m])
        _, out = ragged_step(part, 2)(*part.args(cache))
        outs.append(out)
    assert torch.equal(cache, cache_whole)
    q_whole = rope_append(*whole.args(whole.cache.clone())[:8], whole.layer, whole.heads, whole.kv_heads, EPS,
                          whole.batch.qo_indptr)
    ref = dense_ragged_attention(q_whole, cache, whole.batch, whole.layer, whole.scale)
    bound = attention_bound(torch.float32, 128, n, False)
    assert relative_error(torch.cat(outs), ref) <= bound and relative_error(out_whole, ref) <= bound


def test_decode_rows_are_the_decode_form():
    """qo_indptr = 0, 1, …, B (one new row per sequence) is the decode form: the same cache
    bit for bit and the same attention within the bound."""
    g = _gen()
    case = random_case(ragged_batch([0, 6, 40, 300], [1, 1, 1, 1], 16, g), 8, 2, 64, qk_norm=True, g=g)
    q, out, cache = _eager(case, 2)
    decode_cache = case.cache.clone()
    args = case.args(decode_cache)[:8]
    q_dec = rope_append(*args, case.layer, case.heads, case.kv_heads, EPS)
    out_dec = paged_attention(q_dec, decode_cache, *case.batch.tables(), case.layer, case.scale, 2)
    assert torch.equal(decode_cache, cache) and torch.equal(q_dec, q)
    assert relative_error(out, out_dec) <= attention_bound(torch.float32, 64, 300, False)


def _compile(case: RaggedCase, splits: int, **options):
    return torch.compile(ragged_step(case, splits), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "cpu", **options})


# the default tiles; tiles that cut sequences' rows, kv heads off their query groups' first
# heads, and chunks; and one tile per op
PARTITIONS = [{}, {"rope_append": [5, 3, 1], "attn_partial": [7, 2, 3, 1, 1], "attn_merge": [4, 3, 1]},
              {"rope_append": [1, 1, 1], "attn_partial": [1, 1, 1, 1, 1], "attn_merge": [1, 1, 1]}]


@pytest.mark.parametrize("partition", PARTITIONS, ids=["default", "odd", "one"])
def test_compiled_mixed_batch_matches_dense(partition):
    """The compiled ragged step (CPU executor: random schedules, race tracking, and the
    happens-before check at compile time) against float64 and eager, its cache bit for bit
    the eager one's."""
    g = _gen()
    case = random_case(ragged_batch(MIXED_PREFIX, MIXED_NEW, 16, g, padding=3), 8, 2, 64, qk_norm=True, g=g)
    _, out_eager, cache_eager = _eager(case, 3)
    for seed in range(2):
        cache = case.cache.clone()
        with torch.no_grad():
            q, out = _compile(case, 3, partition=partition, seed=seed)(*case.args(cache))
        check_ragged(case, q, out, cache)
        assert torch.equal(cache, cache_eager)
        assert relative_error(out, out_eager) <= 2 * attention_bound(torch.float32, 64, max(case.batch.lens), False)
    kinds = [op.kind for op in COMPILED[-1].graph.ops]
    # no rope fusion in the ragged form; chunks: the balanced split's plan
    assert kinds == ["rope_append", "attn_plan", "attn_partial", "attn_merge"]


def _plan_case(lens: list[int], rows: int, chunks: int, target: int):
    seq = torch.arange(len(lens))
    pos = torch.tensor(lens) - 1
    cost = block_costs(seq, pos, rows)
    items, start = plan_items(attention_plan(cost, chunks, target), -(-len(lens) // rows), chunks)
    return cost, items, start


def test_attention_plan_splits_a_long_sequence_and_keeps_items_even():
    """FlashInfer's balanced split: one long decode and 15 short ones (random lengths) get items
    of at most L positions, the long one many, every non-empty block at least one, blocks' items
    contiguous and in order, at most W in all; equal lengths get equal counts."""
    rng = random.Random(random.randrange(1 << 30))
    lens = [rng.randrange(8000, 16000)] + [rng.randrange(1, 600) for _ in range(15)]
    cost, items, start = _plan_case(lens, 1, 2, 16)
    counts = start[1:] - start[:-1]
    W = 32
    L = max(MIN_CHUNK, -(-sum(lens) // min(16, W - 16)))
    assert int(start[-1]) <= W and bool((counts >= 1).all())
    assert bool((-(-cost // counts) <= L).all())  # no item longer than L
    assert counts.tolist() == (-(-cost // L)).tolist()
    assert int(counts[0]) > 2  # the long one: many items, not the static split's 2
    assert items[: int(start[-1])].tolist() == torch.repeat_interleave(torch.arange(16), counts).tolist()
    assert bool((items[int(start[-1]):] == -1).all())
    _, _, even = _plan_case([rng.randrange(3000, 4000)] * 8, 1, 4, 16)
    assert len(set((even[1:] - even[:-1]).tolist())) == 1


def test_compiled_skewed_batch_is_balanced_and_matches_dense():
    """One long sequence and 15 short ones, one new row each, as a ragged step (CPU executor)
    against float64: the plan gives the long sequence more items than any static split of two
    chunks would, and the merge puts them back together."""
    g = _gen()
    short = torch.randint(1, 100, (15,), generator=g).tolist()
    case = random_case(ragged_batch([1500] + short, [1] * 16, 16, g), 8, 2, 64, qk_norm=True, g=g)
    with torch.no_grad():
        cache = case.cache.clone()
        q, out = _compile(case, 0)(*case.args(cache))
    check_ragged(case, q, out, cache)
    graph = COMPILED[-1].graph
    plan_op = next(op for op in graph.ops if op.kind == "attn_plan")
    assert plan_op.attrs["chunks"] >= 2 and plan_op.attrs["rows"] == 1
    lens = [1501] + [n + 1 for n in short]
    _, _, start = _plan_case(lens, 1, plan_op.attrs["chunks"], plan_op.attrs["target"])
    assert int(start[1] - start[0]) > plan_op.attrs["chunks"]


def test_compiled_prefill_tiles_hold_blocks_of_rows():
    """A prefill's attention tiles hold at least rows_per_tile rows (MMA_ROWS / G: the
    tensor-core task's query rows), kv heads and chunks being split first; a step of at most
    DECODE_ROWS rows takes one row per tile. The compiled step matches float64."""
    assert rows_per_tile(DECODE_ROWS, 4) == 1 and rows_per_tile(DECODE_ROWS + 1, 4) == MMA_ROWS // 4
    g = _gen()
    case = random_case(ragged_batch([0, 0], [300, 17], 16, g), 8, 2, 64, qk_norm=False, g=g)
    cache = case.cache.clone()
    with torch.no_grad():
        q, out = _compile(case, 1)(*case.args(cache))
    check_ragged(case, q, out, cache)
    attn = next(op for op in COMPILED[-1].graph.ops if op.kind == "attn_partial")
    rows = attn.attrs["rows"]
    assert rows == MMA_ROWS // 4 and attn.attrs["final"] and attn.attrs["ragged"]
    grid = attn.partition
    assert grid[1] == 2 and case.batch.tokens // grid[0] >= rows, grid


def test_prefill_attention_tiles_are_dealt_by_their_causal_work():
    """A one-prompt prefill's attention: up to PREFILL_TILES_PER_WORKER tiles a worker, whose
    work grows with their rows' positions, dealt so that no worker's summed tile cost is over
    1.1× the mean (round-robin gave the worker of the last rows of every kv head twice the
    mean); each queue stays in linear order. The step matches float64."""
    from mpk.compiler.partition import split_bounds
    from mpk.compiler.tables import validate_placement
    from mpk.ops.paged import PREFILL_TILES_PER_WORKER, _attention_cost

    g = _gen()
    workers = 32  # as many as a kv head's row blocks: round-robin gives each worker one block of every head
    case = random_case(ragged_batch([0], [512], 16, g), 8, 2, 64, qk_norm=False, g=g)
    cache = case.cache.clone()
    with torch.no_grad():
        q, out = _compile(case, 1, num_workers=workers)(*case.args(cache))
    check_ragged(case, q, out, cache)
    compiled = COMPILED[-1]
    tables = compiled.tables
    validate_placement(tables)
    attn = next(op for op in compiled.graph.ops if op.kind == "attn_partial")
    grid, T = attn.partition, case.batch.tokens
    assert grid[1] == 2 and grid[0] == min(T // attn.attrs["rows"], PREFILL_TILES_PER_WORKER * workers // 2)
    sig = registry.OpSig((), (), torch.float32, attn.attrs)
    bounds = split_bounds(T, grid[0])
    load = [0.0] * workers
    costs = []
    for w, queue in enumerate(tables.worker_queues()):
        for t in queue:
            if tables.tasks["op"][t] == attn.id:
                block = int(tables.tasks["tile"][t]) // grid[1]
                c = _attention_cost(sig, ((bounds[block], bounds[block + 1]),))
                load[w] += c
                costs.append(c)
    assert len(costs) == grid[0] * grid[1]
    mean = sum(costs) / workers
    assert max(load) <= 1.1 * mean, (load, mean)


def test_verify_flags_attention_not_ordered_after_other_rows_appends(monkeypatch):
    """A ragged attention tile reads k/v that rope_append tiles of other rows append: its q
    region over every row of its kv heads' groups is what orders it after them. The compiled
    tables verify; with that region cut to the tile's own rows, the happens-before check names
    an append of another row that the attention does not wait for, in the cache's key space."""
    from mpk.inspection import compile_module

    g = _gen()
    case = random_case(ragged_batch([5, 0], [4, 6], 4, g), 4, 2, 64, qk_norm=False, g=g)

    class Step(torch.nn.Module):
        def forward(self, qkv, cos_sin, indptr, indices, last, kv_cache, q_norm, k_norm, qo):
            return ragged_step(case, 1)(qkv, cos_sin, indptr, indices, last, kv_cache, q_norm, k_norm, qo)

    partition = {"rope_append": [2, 1, 1], "attn_partial": [2, 2, 1, 1]}
    compiled = compile_module(Step(), case.args(case.cache.clone()), {"num_workers": 1, "partition": partition})
    verify(compiled.tables)
    opdef = registry.REGISTRY["attn_partial"]

    def own_rows(sig, rect):
        regions = opdef.input_regions(sig, rect)
        return [(rect[0],) + regions[0][1:]] + regions[1:]

    cut = dataclasses.replace(opdef, input_regions=own_rows)
    monkeypatch.setitem(registry.REGISTRY, "attn_partial", cut)
    monkeypatch.setitem(registry._BY_TYPE_ID, opdef.type_id, cut)
    torch._dynamo.reset()
    compiled = compile_module(Step(), case.args(case.cache.clone()), {"num_workers": 1, "partition": partition})
    with pytest.raises(VerifyError) as info:
        verify(compiled.tables)
    err = info.value
    kinds = [m["kind"] for m in compiled.tables.meta["ops"]]
    tasks = compiled.tables.tasks["op"]
    assert err.pairs and all(kinds[tasks[w]] == "rope_append" and kinds[tasks[r]] == "attn_partial"
                             for w, r in err.pairs)
    assert "appended by it" in str(err) and "key (layer 1, kv head " in str(err) and ", row " in str(err) and err.buffer == "kv_cache"


def _bad_tables(case: RaggedCase) -> list[tuple[dict, str]]:
    """(replaced arguments, the BadInputError's message) for each way a ragged step's tables
    can be wrong at run time (case: sequences of 5 and 9 positions, 3 and 4 new rows, 9 rows)."""
    qo = case.batch.qo_indptr
    lens = case.batch.lens
    limit = r"0…9 \(the step's token rows\), or breaks qo_indptr's order"
    return [({"qo": torch.tensor([1, 3, 7], dtype=torch.int32)}, rf"qo_indptr entry 1 at row 0 is outside {limit}"),
            ({"qo": torch.tensor([0, 5, 4], dtype=torch.int32)}, rf"qo_indptr entry 4 at row 2 is outside {limit}"),
            ({"qo": torch.tensor([0, 3, 10], dtype=torch.int32)}, rf"qo_indptr entry 10 at row 2 is outside {limit}"),
            ({"qo": torch.tensor([0, 6, 7], dtype=torch.int32)},
             rf"new-row count \(qo_indptr\[row \+ 1\] − qo_indptr\[row\]\) 6 at row 0 is outside 0…{lens[0]}, the "
             r"sequence's length in the page table"),
            ({"cos_sin": case.cos_sin[:8]}, r"rope_append: position of a new row .* 8 at row 6 is outside the rope "
                                            r"table's 8 positions \[0, 8\)")] if qo.tolist() == [0, 3, 7] else []


def test_bad_ragged_tables_are_named():
    """Eager and on the CPU executor, each fault of qo_indptr (entry 0 not 0, an entry below the
    one before, the last past the rows, more new rows than a sequence's length) and a new row
    past the rope table are BadInputErrors naming the entry, the value and what was expected
    (worded as the GPU executor reports them: mpk.errors.BAD_INPUTS); wrong shapes and dtypes
    of qo_indptr are refused before anything runs."""
    g = _gen()
    case = random_case(ragged_batch([2, 5], [3, 4], 4, g, padding=2), 4, 2, 64, qk_norm=False, g=g)
    faults = _bad_tables(case)
    assert len(faults) == 5
    compiled = _compile(case, 1)
    for change, message in faults:
        args = dict(zip(("qkv", "cos_sin", "indptr", "indices", "last", "cache", "q_norm", "k_norm", "qo"),
                        case.args(case.cache.clone())))
        if "cos_sin" in change:  # (another shape: another graph)
            torch._dynamo.reset()
            compiled = _compile(case, 1)
        args |= change
        with pytest.raises(BadInputError, match=message):
            ragged_step(case, 1)(*args.values())
        with pytest.raises(BadInputError, match=message), torch.no_grad():
            compiled(*args.values())
    q = torch.randn(case.batch.tokens, 4, 64)
    tables = case.batch.tables()
    for qo, message in ((torch.tensor([0, 3], dtype=torch.int32), r"qo_indptr has shape \(2,\); expected \(3,\)"),
                        (torch.tensor([0, 3, 7]), "qo_indptr is int64; expected the page table's integer type int32")):
        with pytest.raises(BadInputError, match=message):
            paged_attention(q, case.cache, *tables, 1, 0.1, 1, qo)
        with pytest.raises(BadInputError, match=message):
            rope_append(*case.args()[:8], 1, 4, 2, EPS, qo)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"qo_indptr has shape \(2,\)"), torch.no_grad():
        _compile(case, 1)(*case.args(case.cache.clone())[:8], torch.tensor([0, 3], dtype=torch.int32))
