"""Decode iterations inside one launch (mpk.llm.multistep, mpk.ops.iteration): the advance task's
semantics by hand, k iterations of the CPU interpreter against k single launches (bit for bit)
and against an independent host loop over eager steps (page crossings, a stop token, max_tokens,
max_len and a free list running dry mid-burst), seeded sampling, the happens-before check of
the advance's writes, bad options, and the nvcc build of the graph with the advance task."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.backend import iterations
from mpk.errors import OptionError, VerifyError
from mpk.executors import build
from mpk.llm.buckets import TokenBuckets, prefill
from mpk.llm.kv_cache import PagedKVCache
from mpk.llm.model import DecoderLM
from mpk.llm.multistep import MultiStepDecode, Row
from mpk.ops.iteration import DONE, GEN, LEN, MAX, POOL_FIELDS, SEQ_FIELDS, advance
from mpk.testing.decode import small_config

PS, MAX_LEN, K = 4, 40, 12
needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")


def _state(lens, gens, maxes, stops, tables, free, S=2, P=4):
    B = len(lens)
    seqs = torch.zeros(B, SEQ_FIELDS + S + P, dtype=torch.int32)
    seqs[:, SEQ_FIELDS: SEQ_FIELDS + S] = -1
    for b in range(B):
        seqs[b, [LEN, GEN, MAX]] = torch.tensor([lens[b], gens[b], maxes[b]], dtype=torch.int32)
        seqs[b, SEQ_FIELDS: SEQ_FIELDS + len(stops[b])] = torch.tensor(stops[b], dtype=torch.int32)
        seqs[b, SEQ_FIELDS + S: SEQ_FIELDS + S + len(tables[b])] = torch.tensor(tables[b], dtype=torch.int32)
    pool = torch.tensor([0, len(free), *free], dtype=torch.int32)
    return seqs, pool


def test_advance_grows_pops_stops_and_rebuilds_the_table():
    """Row 0 crosses a page (takes the free list's top), row 1 crosses too but the list is then
    empty (stops, its token emitted, not fed back), row 2 hits its stop id, row 3 its max_tokens,
    row 4 is done already (untouched, −1); the page table is rebuilt from the lengths."""
    seqs, pool = _state(lens=[4, 8, 5, 6, 3], gens=[1, 1, 1, 2, 0], maxes=[9, 9, 9, 3, 9],
                        stops=[[], [], [77], [], []], tables=[[10], [11, 12], [13, 14], [15, 16], [17]], free=[20])
    seqs[4, DONE] = 1
    tokens = torch.tensor([1, 2, 3, 4, 5])
    out = torch.full((2, 5), -9, dtype=torch.int32)
    indptr, indices, last = (torch.zeros(n, dtype=torch.int32) for n in (6, 20, 5))
    nxt = torch.tensor([40, 41, 77, 43, 44])
    emitted = advance(nxt, tokens, indptr, indices, last, seqs, pool, out, page_size=PS, max_len=MAX_LEN, stops=2)
    assert emitted.tolist() == [40, 41, 77, 43, -1]
    assert out[0].tolist() == [40, 41, 77, 43, -1] and out[1].tolist() == [-9] * 5
    assert tokens.tolist() == [40, 2, 3, 4, 5]  # only the live, fed row
    assert seqs[:, LEN].tolist() == [5, 8, 5, 6, 3] and seqs[:, DONE].tolist() == [0, 1, 1, 1, 1]
    assert seqs[:, GEN].tolist() == [2, 2, 2, 3, 0]
    assert seqs[0, SEQ_FIELDS + 2 + 1] == 20 and pool[:POOL_FIELDS].tolist() == [1, 0]
    assert indptr.tolist() == [0, 2, 4, 6, 8, 9]
    assert indices[:9].tolist() == [10, 20, 11, 12, 13, 14, 15, 16, 17]
    assert last.tolist() == [1, 4, 1, 2, 3]


def _model() -> DecoderLM:
    return DecoderLM(small_config("qwen3"), torch.float32, max_len=MAX_LEN).randomize(random.randrange(1 << 30), 0.3)


def _prompts(vocab: int, lens: list[int]) -> list[list[int]]:
    return [[random.randrange(vocab) for _ in range(n)] for n in lens]


def _scenario(model, prompts):
    """``prompts`` prefilled eagerly and their first tokens, the cache grown by them (the same
    pages for the same prompts): (kv, steps, first tokens)."""
    kv = PagedKVCache(model, len(prompts), MAX_LEN, PS)
    steps = TokenBuckets(model, kv, 64, eager=True)
    with torch.no_grad():
        logits = prefill(steps, prompts)
    kv.grow(1)
    return kv, steps, logits.argmax(-1).tolist()


def _gap(row: torch.Tensor) -> float:
    top = torch.topk(row.double(), 2).values
    return float(top[0] - top[1])


def _reference(kv, steps, first, k, maxes, stops, free):
    """The burst by the host: eager steps (TokenBuckets.run over a PagedKVCache), greedy, the
    stop rules and the free list applied per row in row order. Per row: (tokens, gaps of the
    logits that chose them, why it stopped or None)."""
    B = kv.batch
    tok, gen, lens = list(first), [1] * B, list(kv.lens)
    live, counts = [True] * B, [1] * B
    out = [([], [], None) for _ in range(B)]
    for _ in range(k):
        with torch.no_grad():
            logits = steps.run([tok[b] for b in range(B) if counts[b]], counts)
        counts = [0] * B
        for b in range(B):
            if not live[b]:
                continue
            t = int(logits[b].argmax())
            out[b][0].append(t)
            out[b][1].append(_gap(logits[b]))
            gen[b] += 1
            n = lens[b] + 1
            why = ("stop" if t in stops[b] else "max_tokens" if gen[b] >= maxes[b] else "max_len" if n >= MAX_LEN
                   else None)
            if why is None and (n - 1) % PS == 0:
                if free == 0:
                    why = "pages"
                else:
                    free -= 1
            if why:
                live[b] = False
                out[b] = (*out[b][:2], why)
            else:
                lens[b], tok[b], counts[b] = n, t, 1
        if not any(live):
            break
        kv.grow(counts)
    return out


def _compare(ref, got, tol=1e-4) -> int:
    """Row by row: equal tokens up to the first near-tie of the reference (its gap < tol), the
    whole row when there is none; returns the tokens compared."""
    n = 0
    for (tokens, gaps, _), g in zip(ref, got):
        cut = next((i for i, x in enumerate(gaps) if x < tol), len(tokens))
        assert g[:cut] == tokens[:cut]
        if cut == len(tokens):
            assert g == tokens
        n += cut
    return n


def _multistep(model, kv, first, free, executor, maxes, stops, cache=None, **kw):
    ms = MultiStepDecode(model, kv.cache.clone() if cache is None else cache, kv.batch, PS, MAX_LEN, K, 16,
                         executor, {"num_workers": 8, **kw})
    rows = [Row(first[b], kv.lens[b], list(kv.tables[b].pages), 1, maxes[b], stops[b]) for b in range(kv.batch)]
    ms.load(rows, free)
    return ms


def test_iterations_in_one_launch_give_the_tokens_of_single_steps():
    """K iterations in one interpreter launch equal K single launches bit for bit (every state
    tensor and the cache), and both the interpreter's and the eager module's tokens equal a host
    loop over eager steps up to near-ties — through page crossings, a stop token, max_tokens,
    max_len and a free list that runs dry mid-burst (each happens: checked)."""
    model = _model()
    # rows 1-3 never cross a page before they stop (their first fed positions are 2 mod 4, the
    # last one's prompt ends 3 short of MAX_LEN), so row 0 alone, crossing at least twice in 11
    # fed positions, runs the one free page dry: every stop reason happens, each as planned
    prompts = _prompts(model.cfg.vocab, [random.randint(2, 12), 4 * random.randint(1, 3) + 1,
                                         4 * random.randint(1, 3) + 1, MAX_LEN - 3])
    maxes = [100, 3, 100, 100]
    # row 2 stops at a token it generates: run the reference once to find one
    kv, steps, first = _scenario(model, prompts)
    free = list(kv.free)[-1:]
    probe = _reference(kv, steps, first, K, maxes, [[], [], [], []], len(free))
    stops = [[], [], [probe[2][0][1]], []]
    kv, steps, first = _scenario(model, prompts)
    tables = [list(t.pages) for t in kv.tables]
    # (each takes its own copy of the cache and the rows before the reference moves on)
    eager = _multistep(model, kv, first, free, "eager", maxes, stops)
    one = _multistep(model, kv, first, free, "cpu", maxes, stops, seed=random.randrange(100))
    single = _multistep(model, kv, first, free, "cpu", maxes, stops, seed=random.randrange(100))
    ref = _reference(kv, steps, first, K, maxes, stops, len(free))
    assert [r[2] for r in ref] == ["pages", "max_tokens", "stop", "max_len"]

    eager.run(K)
    compared = _compare(ref, eager.read(K, kv.batch).tokens)

    one.run(K)
    burst = one.read(K, kv.batch)
    compared += _compare(ref, burst.tokens)
    assert compared >= 2 * 0.8 * sum(len(r[0]) for r in ref)  # else near-ties decided all and it proved little
    assert burst.done == [r[2] is not None for r in ref]
    assert burst.free_left == len(free) - sum(len(p) for p in burst.pages) + sum(len(t) for t in tables)

    for _ in range(K):
        single.run(1)
    for a, b in zip(one.args(), single.args()):
        assert torch.equal(a, b)


def test_seeded_sampled_rows_reproduce():
    """Greedy and sampled rows in one batch: two launches from the same state and seeds give the
    same tokens bit for bit, and one launch of K equals K launches of one."""
    model = _model()
    kv, _, first = _scenario(model, _prompts(model.cfg.vocab, [random.randint(2, 12) for _ in range(3)]))
    seeds = [random.randrange(-(1 << 63), 1 << 63) for _ in range(3)]
    rows = [Row(first[b], kv.lens[b], list(kv.tables[b].pages), 1, 100, (), temperature=t, top_k=k, top_p=p,
                seed=seeds[b]) for b, (t, k, p) in enumerate([(0.0, 0, 1.0), (0.9, 20, 0.95), (1.3, 0, 1.0)])]
    free = list(kv.free)[-12:]  # 3 rows × K / PS crossings at most
    runs = []
    for plan in ([K], [K], [1] * K):
        ms = MultiStepDecode(model, kv.cache.clone(), 3, PS, MAX_LEN, K, 12, "cpu", {"num_workers": 8})
        ms.load(rows, free)
        for k in plan:
            ms.run(k)
        runs.append(ms.out.tolist())
    assert runs[0] == runs[1] == runs[2]
    # (vocabulary 97 is padded to 100 with -inf logits for the sampler: never drawn)
    assert all(0 <= t < model.cfg.vocab for row in runs[0] for t in row)


class _ReadsTokensBesides(torch.nn.Module):
    """The advance, and an output reading ``tokens`` that it does not wait for."""

    def forward(self, logits, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out):
        nxt = torch.argmax(logits, -1)
        emitted = torch.ops.mpk.decode_advance(nxt, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out,
                                               PS, MAX_LEN, 0)
        return emitted, tokens * 2


def test_happens_before_check_rejects_a_reader_not_ordered_before_the_advance():
    B, P = 2, MAX_LEN // PS
    args = (torch.randn(B, 16), torch.zeros(B, dtype=torch.long), torch.zeros(B + 1, dtype=torch.int32),
            torch.zeros(B * P, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
            torch.zeros(B, SEQ_FIELDS + P, dtype=torch.int32), torch.zeros(POOL_FIELDS + 4, dtype=torch.int32),
            torch.zeros(3, B, dtype=torch.int32))
    compiled = torch.compile(_ReadsTokensBesides(), backend="mpk", options={"executor": "cpu", "num_workers": 4})
    with pytest.raises(Exception) as info, torch.no_grad():
        compiled(*args)
    err = info.value
    while not isinstance(err, VerifyError) and err is not None:
        err = getattr(err, "inner_exception", None) or err.__cause__
    assert isinstance(err, VerifyError) and "next iteration" in str(err) and "'tokens'" in str(err)


@pytest.mark.parametrize("k", [0, -1, 1.5, True, 2 ** 31])
def test_bad_iteration_counts_raise(k):
    with pytest.raises(OptionError, match="iterations"), iterations(k):
        pass


def test_run_past_the_ring_raises():
    model = _model()
    ms = MultiStepDecode(model, model.new_cache(8, PS), 1, PS, MAX_LEN, 4, 4, "eager")
    with pytest.raises(OptionError, match="1 … 4"):
        ms.run(5)


@needs_nvcc
def test_multistep_graph_builds_for_sm90a(tmp_path, monkeypatch):
    """The bf16 graph (decode step, sampler, advance) compiles with nvcc; its attention reads the
    page table after its gate (the advance rewrites it inside the launch)."""
    from mpk.executors.codegen import generate

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    model = DecoderLM(small_config("qwen3", vocab=260, head_dim=64), torch.bfloat16, max_len=128).randomize(0)
    ms = MultiStepDecode(model, model.new_cache(32, 16), 4, 16, 128, 8, 32, "gpu", {"num_workers": 16, "verify": True})
    src = generate(ms.trace().tables)
    assert "mpk::task_decode_advance" in src
    assert any("attn_partial<" in line and line.count("true") >= 3 and ", true>" in line for line in src.splitlines())
    cubin = build.build_cubin(src, "sm_90a")
    assert cubin.read_bytes()[:4] == b"\x7fELF"
