"""Prefill and mixed steps on the CPU: ``DecoderLM``'s ragged step (``qo_indptr``) against
Hugging Face transformers with the same weights, compiled (the CPU interpreter) and eager; mixed
batches against the sequences run alone; ``TokenBuckets`` (the bucket a step runs, padding,
no recompilation) and ``PagedKVCache.qo_indptr``.

Tolerances: float32 logits within ``decoder_logits_bound`` (mpk.testing.tolerance: the
roundings on a logit's way, counted per layer from the config and the positions attended,
for each of the two implementations); bf16 as tests/models/test_llm.py's decode test judges it,
against transformers' float32 logits and its own bf16 run's error.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import zlib

import pytest
import torch

from mpk.backend import COMPILED
from mpk.errors import BadInputError, MpkError, OptionError
from mpk.executors.interpreter import Interpreter
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, TokenBuckets, default_buckets, prefill
from mpk.llm.buckets import SKEW_POSITIONS
from mpk.testing.decode import small_config
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import decoder_logits_bound

# the interpreter simulates few workers: small grids keep each step to a few hundred tasks
CPU = {"executor": "cpu", "num_workers": 8}
LENGTHS = [1, 7, 16, 17, 300]  # a token, odd, a page of 16, one past it, many pages (and chunks of 64)


def small(family: str, **kw) -> LLMConfig:
    """``small_config`` with room for the longest prompt's positions."""
    return small_config(family, **({"max_position": 4096} | kw))


def hf_twin(cfg: LLMConfig, dtype: torch.dtype, max_len: int, seed: int | None = None):
    """(transformers model, DecoderLM) with the same random weights; skips without transformers."""
    pytest.importorskip("transformers")
    from mpk.testing.parity import hf_twin as twin

    return twin(cfg, seed=random.randrange(1 << 30) if seed is None else seed, dtype=dtype, max_len=max_len)


@functools.cache
def shared_twin(family: str):
    """A float32 ``hf_twin`` of ``small(family)`` for 512 positions, made once per run (each
    takes seconds), its weights drawn from the run's seed (MPK_TEST_SEED replays them)."""
    seed = zlib.crc32(f"{os.environ['MPK_TEST_SEED']}:twin:{family}".encode())
    return hf_twin(small(family), torch.float32, 512, seed)


def hf_last(hf, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float logits after each prompt's last token (one causal forward each)."""
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].float() for p in prompts]


def random_prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    """Random token ids, a list of each length."""
    return [torch.randint(0, vocab, (n,)).tolist() for n in lengths]


@pytest.fixture
def ran_rows(monkeypatch) -> list[int]:
    """The token rows of each graph the CPU interpreter runs (its tokens input's length)."""
    rows: list[int] = []
    run = Interpreter.run

    def spy(self, args, *a, **kw):
        rows.append(next(int(t.shape[0]) for t in args if t.dtype == torch.int64 and t.dim() == 1))
        return run(self, args, *a, **kw)

    monkeypatch.setattr(Interpreter, "run", spy)
    return rows


@pytest.mark.parametrize("family,page_size", [("llama", 1), ("qwen3", 1), ("llama", 16), ("qwen3", 16),
                                              ("llama", 256), ("qwen3", 256)])
def test_prefill_matches_transformers(family, page_size):
    """Prompts of 1, 7, 16, 17 and 300 tokens side by side in one cache, prefilled whole (one
    step of 341 tokens on the 512 bucket) and in chunks of 64 (a chunk ends mid-prompt, the next
    prompt starts in the same step), compiled and eager: each prompt's last logits within the
    float32 bound of transformers' (its positions: up to 300 attended)."""
    cfg = small(family)
    hf, model = shared_twin(family)
    lengths = random.sample(LENGTHS, len(LENGTHS))
    prompts = random_prompts(lengths, cfg.vocab)
    refs = hf_last(hf, prompts)
    bound = decoder_logits_bound(cfg, max(LENGTHS), torch.float32)
    for eager in (False, True):
        kv = PagedKVCache(model, len(prompts), 320, page_size)
        steps = TokenBuckets(model, kv, buckets=[64, 512], decode=False, options=CPU, eager=eager)
        for chunk in (None, 64):
            kv.reset()
            out = prefill(steps, prompts, chunk)
            for b, ref in enumerate(refs):
                err = relative_error(out[b], ref)
                assert err <= bound, (eager, chunk, lengths[b], err, bound)


def test_long_prompt_in_chunks_of_512():
    """A prompt of 2049 tokens (four full chunks of 512 and one token) beside one of 3,
    prefilled compiled in chunks of 512 (the last step, 1 + 3 tokens, on the 8 bucket) and
    eagerly whole: both prompts' last logits within the float32 bound of transformers'. One
    layer: the interpreter's time grows with rows × positions attended, and the other tests
    cover the layers' stacking."""
    cfg = small("qwen3", layers=1)
    hf, model = hf_twin(cfg, torch.float32, max_len=2112)
    prompts = random_prompts([2049, 3], cfg.vocab)
    refs = hf_last(hf, prompts)
    bound = decoder_logits_bound(cfg, 2049, torch.float32)
    for eager, buckets, chunk in ((False, [8, 512], 512), (True, [2052], None)):
        steps = TokenBuckets(model, PagedKVCache(model, 2, 2049, 16), buckets=buckets, decode=False, options=CPU,
                             eager=eager)
        out = prefill(steps, prompts, chunk)
        for b, ref in enumerate(refs):
            assert relative_error(out[b], ref) <= bound, (eager, b)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_prefill_agrees_with_transformers(family):
    """bf16, two prompts of 48 tokens prefilled in one compiled step, every position's logits
    (logits="all") against transformers' float32 logits: within 5% of the largest |logit|, the
    median error within 1.25× that of transformers' own bf16 run, top-1 agreement ≥ 99% where
    the reference is decisive (mpk.testing.parity.compare_logits)."""
    from mpk.testing.parity import compare_logits, hf_logits

    cfg = small(family)
    hf, model = hf_twin(cfg, torch.bfloat16, max_len=64)
    tokens = torch.randint(0, cfg.vocab, (2, 48))
    ref_bf16, ref = hf_logits(hf, tokens), hf_logits(hf.float(), tokens)
    kv = PagedKVCache(model, 2, 64, 16)
    steps = TokenBuckets(model, kv, buckets=[96], decode=False, logits="all", options=CPU)
    out = steps.step(tokens.tolist()).float().reshape(2, 48, -1)
    stats, hf_own = compare_logits(out, ref), compare_logits(ref_bf16, ref)
    assert stats["max_rel"] <= 0.05 and stats["top1_decisive"] >= 0.99, stats
    assert stats["median_rel"] <= 1.25 * hf_own["median_rel"], (stats, hf_own)


def alone(model: DecoderLM, chunks: list[list[int]], page_size: int) -> list[torch.Tensor]:
    """One sequence fed ``chunks`` one step each, alone (eager, batch 1): each step's logits
    ([chunk, vocab])."""
    kv = PagedKVCache(model, 1, 512, page_size)
    steps = TokenBuckets(model, kv, buckets=[512], decode=False, logits="all", eager=True)
    return [steps.step([chunk]) for chunk in chunks]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_equals_sequences_run_alone(family, ran_rows):
    """Skewed lengths in one batch: sequences 1-3 prefill prompts of 1, 2 and 5 tokens, then
    sequence 0 prefills 150 tokens in chunks of 48 while the others decode (sequence 2 sits out
    one step, sequence 3 another); every step's logits of each sequence (logits="all",
    compiled) equal, within the float32 bound, those of that sequence fed the same chunks alone,
    eagerly. The step where every sequence decodes runs the decode graph, the others a bucket."""
    cfg = small(family)
    model = DecoderLM(cfg, torch.float32, max_len=512).randomize(seed=random.randrange(1 << 30), scale=0.1)
    kv = PagedKVCache(model, 4, 256, 4)
    steps = TokenBuckets(model, kv, max_num_batched_tokens=64, logits="all", options=CPU)
    long = torch.randint(0, cfg.vocab, (150,)).tolist()

    def d() -> list[int]:  # a decode token
        return [random.randrange(cfg.vocab)]

    schedule = [[[], *random_prompts([1, 2, 5], cfg.vocab)], [long[0:48], d(), [], d()],
                [long[48:96], d(), d(), d()], [d(), d(), d(), d()], [long[96:144], d(), d(), []],
                [long[144:150], d(), d(), d()]]
    fed: list[list[list[int]]] = [[] for _ in range(4)]
    outs: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for row in schedule:
        out, off = steps.step(row), 0
        for b, chunk in enumerate(row):
            if chunk:
                outs[b].append(out[off: off + len(chunk)])
                fed[b].append(chunk)
            off += len(chunk)
    assert ran_rows == [8, 64, 64, 4, 64, 16]
    bound = decoder_logits_bound(cfg, 150, torch.float32)
    for b in range(4):
        for i, (got, want) in enumerate(zip(outs[b], alone(model, fed[b], 4), strict=True)):
            assert relative_error(got, want) <= bound, (b, i)


def test_five_tokens_run_the_eight_bucket_and_padding_changes_nothing(ran_rows):
    """A step of 5 new tokens (2 and 3 in sequences 0 and 2, none in 1) runs the graph of 8
    rows; its 3 padding rows write nothing: the cache (random values) differs from before only
    at the 5 new tokens' slots, and equals, with the logits, a run of the same step on a graph of
    exactly 5 rows."""
    cfg = small("qwen3")
    model = DecoderLM(cfg, torch.float32, max_len=64).randomize(seed=random.randrange(1 << 30), scale=0.1)
    caches = [PagedKVCache(model, 3, 32, 4) for _ in range(2)]
    caches[0].cache.normal_()
    caches[1].cache.copy_(caches[0].cache)
    padded = TokenBuckets(model, caches[0], max_num_batched_tokens=8, options=CPU)
    exact = TokenBuckets(model, caches[1], buckets=[5], decode=False, options=CPU)
    assert padded.buckets == [1, 2, 4, 8] and padded.bucket(5) == 8
    before = caches[0].cache.clone()
    prompts = random_prompts([2, 0, 3], cfg.vocab)
    outs = [steps.step(prompts) for steps in (padded, exact)]
    assert ran_rows == [8, 5]
    bound = decoder_logits_bound(cfg, 3, torch.float32)
    assert relative_error(outs[0][[0, 2]], outs[1][[0, 2]]) <= bound
    assert torch.equal(outs[0][1], outs[0][0])  # no new tokens: the row before its slot (clamped)
    # the new tokens' slots: sequence b's pages in order, positions 0… (the cache was empty)
    new = torch.zeros(before.shape[2:5], dtype=torch.bool)  # [pages, kv_heads, page_size]
    for b, n in ((0, 2), (2, 3)):
        for pos in range(n):
            new[caches[0].tables[b].pages[pos // 4], :, pos % 4] = True
    changed = (caches[0].cache != before).any(-1).any(0).any(0)
    assert torch.equal(changed, new)
    assert relative_error(caches[0].cache, caches[1].cache) <= bound


def test_steps_never_recompile(ran_rows):
    """compile() traces every graph once (4 buckets and the decode form: the report names them);
    steps of every size from 1 to 8 tokens and decode steps then add no graph. After
    torch._dynamo.reset() (which drops them all) a graph that ran goes on (its launch is
    replayed), one that never ran is refused, naming compile(); compile() makes them again."""
    cfg = small("llama", layers=1)
    model = DecoderLM(cfg, torch.float32, max_len=128).randomize(seed=random.randrange(1 << 30), scale=0.1)
    kv = PagedKVCache(model, 2, 96, 16)
    steps = TokenBuckets(model, kv, max_num_batched_tokens=8, options=CPU)
    report = steps.compile()
    assert list(report.trace_s) == ["T=1", "T=2", "T=4", "T=8", "decode"] and report.build_s == 0
    assert str(report).startswith("5 graphs traced in ")
    graphs = len(COMPILED)
    steps.step(random_prompts([1, 1], cfg.vocab))
    torch._dynamo.reset()
    steps.step(random_prompts([1, 1], cfg.vocab))
    with pytest.raises(MpkError, match=r"would compile a new graph .* call compile\(\) again"):
        steps.step(random_prompts([1, 2], cfg.vocab))
    steps.compile()
    graphs = len(COMPILED)
    ran_rows.clear()
    for n in range(1, 9):
        steps.step(random_prompts([n // 2, n - n // 2], cfg.vocab))
        steps.step(random_prompts([1, 1], cfg.vocab))
    assert len(COMPILED) == graphs and ran_rows == [r for n in range(1, 9) for r in (steps.bucket(n), 2)]


def test_more_graphs_than_dynamos_recompile_limit(ran_rows):
    """Each bucket is one more Dynamo cache entry of DecoderLM.forward: with recompile_limit 2,
    compile() still traces the 4 graphs (it raises the limit while it traces) and every step
    runs its compiled graph (past the limit Dynamo would have run the model eagerly)."""
    cfg = small("qwen3", layers=1)
    model = DecoderLM(cfg, torch.float32, max_len=64).randomize(seed=random.randrange(1 << 30), scale=0.1)
    kv = PagedKVCache(model, 1, 32, 8)
    with torch._dynamo.config.patch(recompile_limit=2):
        steps = TokenBuckets(model, kv, buckets=[1, 2, 4], options=CPU)
        start = len(COMPILED)
        steps.compile()
        assert len(COMPILED) == start + 4
        for n in (4, 2, 1):
            steps.step([list(range(n))])
    assert len(COMPILED) == start + 4 and ran_rows == [4, 2, 1]  # (one token: the decode graph, batch 1)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gpu_compile_traces_every_graph_then_builds_them_together(monkeypatch, device):
    """With the GPU executor, compile() traces the buckets and the decode form without running
    anything (no executor, no CUDA needed) and hands all their generated sources to one parallel
    build (here captured instead of run by nvcc); also for a model and cache on the meta device,
    as the benchmarks' --prebuild traces them (nothing allocated)."""
    import warnings

    from mpk.executors import build

    built: list[list[str]] = []
    monkeypatch.setattr(build, "prebuild", lambda sources, **kw: built.append(sources) or [])
    cfg = small("qwen3", layers=1, head_dim=64)  # (the GPU's paged attention takes head dims 64, 128, 256)
    model = DecoderLM(cfg, torch.bfloat16, device, max_len=64)
    kv = PagedKVCache(model, 2, 64, 16)
    steps = TokenBuckets(model, kv, buckets=[4, 16], options={"executor": "gpu", "num_workers": 16})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PerformanceWarning: projections of more rows than a decode step's)
        report = steps.compile()
    assert list(report.trace_s) == ["T=4", "T=16", "decode"]
    assert len(built) == 1 and len(built[0]) == 3 and all("mpk_execute_task" in src for src in built[0])
    assert len(set(built[0])) == 3


def test_qo_indptr_follows_grow():
    """grow(n) returns the step's new tokens and writes their rows into qo_indptr in place (its
    address fixed); reset(b) takes sequence b's out."""
    model = DecoderLM(small("llama"), torch.float32, max_len=64)
    kv = PagedKVCache(model, 3, 32, 4)
    address = kv.qo_indptr.data_ptr()
    assert kv.grow([2, 0, 5]) == 7 and kv.qo_indptr.tolist() == [0, 2, 2, 7]
    assert kv.kv_last_page_len.tolist() == [2, 0, 1]
    kv.reset(2)
    assert kv.qo_indptr.tolist() == [0, 2, 2, 2]
    assert kv.grow(1) == 3 and kv.qo_indptr.tolist() == [0, 1, 2, 3]
    kv.grow([0, 2, 1])
    assert kv.qo_indptr.tolist() == [0, 0, 2, 3] and kv.qo_indptr.data_ptr() == address
    kv.reset()
    assert kv.qo_indptr.tolist() == [0] * 4


def test_bad_steps_are_named_and_change_nothing():
    cfg = small("llama", layers=1)
    model = DecoderLM(cfg, torch.float32, max_len=64).randomize(scale=0.1)
    kv = PagedKVCache(model, 2, 16, 4)
    steps = TokenBuckets(model, kv, max_num_batched_tokens=4, options=CPU, eager=True)
    for bad, message in [([[1, 2, 3], [4, 5]], r"a step of 5 new tokens; expected 1…4"),
                         ([[1], [2], [3]], r"tokens for 3 sequences; expected one list per sequence of the cache \(2"),
                         ([[1], [cfg.vocab]], rf"token id {cfg.vocab} of sequence 1 is outside"),
                         ([[], []], r"a step of 0 new tokens")]:
        with pytest.raises(BadInputError, match=message):
            steps.step(bad)
        assert kv.lens == [0, 0]
    kv.grow([15, 0])
    with pytest.raises(MpkError, match="sequence 0 would reach 17 tokens; max_len is 16"):
        steps.step([[1, 2], [3]])
    assert kv.lens == [15, 0]
    with pytest.raises(OptionError, match=r"chunk=5; expected None or 1…4"):
        prefill(steps, [[1], [2]], 5)
    for kw, message in [({}, "expected max_num_batched_tokens or buckets"),
                        ({"buckets": [0, 4]}, r"buckets=\[0, 4\]; expected row counts"),
                        ({"buckets": [2, 4], "max_num_batched_tokens": 8}, "expected the largest bucket"),
                        ({"max_num_batched_tokens": 4, "logits": "first"}, "logits='first'; expected one of")]:
        with pytest.raises(OptionError, match=message):
            TokenBuckets(model, kv, **kw)
    assert default_buckets(1) == [1] and default_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_ragged_step_inputs_are_checked():
    """A ragged step's qo_indptr must be [B + 1] of the page table's type, and logits "last" or
    "all" (eager: BadInputError; traced: the same message, inside torch's compile error)."""
    model = DecoderLM(small("qwen3"), torch.float32, max_len=16).randomize()
    kv = PagedKVCache(model, 2, 16, 4)
    kv.grow([2, 1])
    tokens = torch.tensor([1, 2, 3])
    step = torch.compile(model, backend="mpk", fullgraph=True, dynamic=False, options=CPU)
    for run, error in ((model, BadInputError), (step, Exception)):
        with pytest.raises(error, match=r"qo_indptr \(3,\) torch.int64; expected \[T\], \[B \+ 1\], \[B\] and "
                                        r"\[B \+ 1\] of the page table's torch.int32"):
            run(tokens, *kv.args(), kv.qo_indptr.long())
        with pytest.raises(error, match=r"logits='first'; expected one of \('last', 'all'\)"):
            run(tokens, *kv.args(), kv.qo_indptr, logits="first")


def test_decode_example_prefills_in_chunks(capsys):
    """examples/decode.py --chunk 2: a 5-token prompt prefilled in 3 steps of the 2-row graph,
    then decode steps; the compiled steps match mpk's eager path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--random", "llama-tiny", "--prompt-ids", "5", "9", "1", "4", "7", "--steps", "3",
                        "--chunk", "2", "--executor", "cpu", "--page-size", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "prefill: 5 token(s) in 3 step(s)" in out and "compile: 2 graphs traced" in out
    assert float(out.split("max |logit|: ")[1].split()[0]) <= 1e-5
    assert len(ast.literal_eval(out.split("generated ids: ")[1].splitlines()[0])) == 3


@pytest.mark.parametrize("long_by", [SKEW_POSITIONS, SKEW_POSITIONS - 1])
def test_skewed_decode_steps_take_the_balanced_ragged_form(long_by):
    """A step of one token per sequence runs the decode form unless one sequence is
    SKEW_POSITIONS past the median (then the bucket's ragged form, whose attention follows the
    balanced split), and both give the same logits."""
    cfg = small_config("llama", max_position=SKEW_POSITIONS + 256)
    model = DecoderLM(cfg, torch.float32, "cpu").randomize(random.randrange(1 << 30))
    cache = PagedKVCache(model, 4, SKEW_POSITIONS + 128, 16)
    steps = TokenBuckets(model, cache, buckets=[4], eager=True)
    forms = []
    run = steps._run
    steps._run = lambda *a, **kw: forms.append("ragged" if "qo_indptr" in kw else "decode") or run(*a, **kw)
    short = random.randrange(1, 40)
    cache.grow([short + long_by, short, short, short])
    one = [[random.randrange(cfg.vocab)] for _ in range(4)]
    got = steps.step(one)
    assert forms == ["ragged" if long_by >= SKEW_POSITIONS else "decode"]
    with torch.no_grad():  # the other form over the same cache and tokens
        ref = model(torch.tensor([t[0] for t in one]), *cache.args(),
                    **({} if forms[0] == "ragged" else {"qo_indptr": cache.qo_indptr}))
    assert relative_error(got, ref) <= decoder_logits_bound(cfg, SKEW_POSITIONS + long_by, torch.float32)
