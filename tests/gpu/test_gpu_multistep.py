"""Decode iterations inside one persistent-kernel launch on the GPU (marker ``gpu``; skipped
without CUDA): the multi-step graph (decode step, in-kernel sampler, the advance task) run as
ONE launch of k iterations picks the model's greedy tokens (teacher-forced against its float32
twin) for a tiny bf16 model through page crossings, a stop token and a free list running dry; seeded sampled rows reproduce bit for bit; and the engine with
``decode_iterations`` picks the model's greedy tokens (teacher-forced against its float32
twin), for the tiny model and the default model's text."""

from __future__ import annotations

import random

import pytest
import torch

from mpk import LLM
from mpk.errors import MpkError
from mpk.llm.default_model import default_model_path
from mpk.llm.kv_cache import PageTable
from mpk.llm.model import DecoderLM
from mpk.llm.multistep import MultiStepDecode, Row
from mpk.testing.decode import float32_twin, small_config
from mpk.testing.engine import VOCAB, greedy, teacher_forced_agreement, tiny_checkpoint
from mpk.testing.parity import DECISIVE_MARGIN

pytestmark = pytest.mark.gpu
PS, MAX_LEN, K = 16, 256, 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head dim 64: the CUDA attention tasks' smallest (the engine tests' checkpoint has 16)
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), small_config("qwen3", vocab=VOCAB, head_dim=64),
                           random.randrange(1 << 30))


def _model() -> DecoderLM:
    # head dim 64: the paged attention task's smallest; vocabulary 260: the sampler pads it to 264
    cfg = small_config("qwen3", vocab=260, head_dim=64, hidden=128, inter=256)
    return DecoderLM(cfg, torch.bfloat16, "cuda", max_len=MAX_LEN).randomize(random.randrange(1 << 30), 0.1)


def _rows(model, batch: int) -> tuple[list[Row], list[int]]:
    """``batch`` rows of random lengths and last tokens over interleaved pages (their context:
    random k/v, ``_launches`` fills the cache), and the pages nobody holds."""
    pages_per_seq = -(-MAX_LEN // PS)
    rows = []
    for b in range(batch):
        length = random.randint(1, 3 * PS)
        pages = [b + batch * i for i in range(-(-length // PS))]
        rows.append(Row(random.randrange(model.cfg.vocab), length, pages, 0, K + 10))
    used = {p for r in rows for p in r.pages}
    return rows, [p for p in range(batch * pages_per_seq) if p not in used]


def _context(model, rows) -> torch.Tensor:
    """The rows' cache: random k/v (seeded: the same for every run of a test)."""
    cache = model.new_cache(len(rows) * -(-MAX_LEN // PS), PS)
    torch.manual_seed(0)
    with torch.no_grad():
        cache.normal_(0, 1)
    return cache


def _launches(model, rows, free, executor: str):
    ms = MultiStepDecode(model, _context(model, rows), len(rows), PS, MAX_LEN, K, len(free), executor)
    ms.load(rows, free)
    ms.run(K)
    return ms.read(K, len(rows))


def _teacher_forced(model, rows, burst) -> dict[str, float]:
    """Each row's burst replayed in ``model``'s float32 twin, a decode step per token over the
    pages the burst gave the row (the same random context, in float32): the share of burst
    tokens that are the twin's argmax where it is decisive (as mpk.testing.engine's
    teacher_forced_agreement), and the share of decisive positions."""
    twin = float32_twin(model)
    agree = decisive = total = 0
    for row, tokens, pages in zip(rows, burst.tokens, burst.pages):
        table = PageTable(twin, 1, len(rows) * -(-MAX_LEN // PS), PS)
        table.cache = _context(model, rows).float()
        fed = [row.token, *tokens[:-1]]
        for i, (t, want) in enumerate(zip(fed, tokens)):
            n = row.length + i  # the sequence's tokens with t
            table.write([pages[: -(-n // PS)]], [n], [1])
            with torch.no_grad():
                logits = twin(torch.tensor([t], device=table.cache.device), *table.args())[0].double()
            best2 = logits.topk(2).values
            if best2[0] - best2[1] > DECISIVE_MARGIN * logits.abs().max():
                decisive += 1
                agree += int(logits.argmax()) == want
            total += 1
    return {"top1_decisive": agree / max(decisive, 1), "decisive_share": decisive / max(total, 1)}


def test_one_launch_of_k_iterations_picks_the_models_tokens():
    """K greedy iterations in ONE launch: teacher-forced, every token is the float32 model's
    argmax wherever it is decisive (≥ 99%), through page crossings, a stop token mid-burst (the
    row ends on it) and a free list running dry (no page handed out twice)."""
    model = _model()
    rows, free = _rows(model, 4)
    first = _launches(model, rows, free, "gpu")
    rows[1].stop_ids = (first.tokens[1][K // 2],)  # row 1 stops mid-burst
    free = free[:3]  # the free list runs dry
    gpu = _launches(model, rows, free, "gpu")
    stats = _teacher_forced(model, rows, gpu)
    assert stats["decisive_share"] >= 0.25 and stats["top1_decisive"] >= 0.99, stats
    if rows[1].stop_ids[0] in gpu.tokens[1]:
        assert gpu.tokens[1][-1] == rows[1].stop_ids[0] and gpu.done[1]
    popped = [p for r, pages in zip(rows, gpu.pages) for p in pages[len(r.pages):]]
    assert len(popped) == len(set(popped)) == 3 - gpu.free_left and set(popped) <= set(free)
    assert all(len(t) == K or d for t, d in zip(gpu.tokens, gpu.done))


def test_seeded_sampling_in_one_launch_reproduces():
    """Sampled and greedy rows: two launches from the same state give the same tokens bit for
    bit, and one launch of K iterations equals K launches of one."""
    model = _model()
    rows, free = _rows(model, 3)
    for r, t in zip(rows, (0.0, 0.8, 1.2)):
        r.temperature, r.top_k, r.top_p, r.seed = t, 50, 0.9, random.randrange(1 << 62)
    a, b = _launches(model, rows, free, "gpu"), _launches(model, rows, free, "gpu")
    assert a.tokens == b.tokens
    ms = MultiStepDecode(model, _context(model, rows), len(rows), PS, MAX_LEN, K, len(free), "gpu")
    ms.load(rows, free)
    for _ in range(K):
        ms.run(1)
    assert ms.read(K, len(rows)).tokens == a.tokens


def test_engine_bursts_pick_the_models_greedy_tokens(checkpoint):
    """12 requests of random lengths through 4 sequences, bursts of 8 iterations on the GPU
    executor (bf16): teacher-forced, the tokens picked are the float32 model's greedy choice
    wherever it is decisive (≥ 99%, as tests/gpu/test_gpu_engine.py judges single steps); every
    page comes back; launches per token fall below half of single steps'."""
    prompts = [[random.randrange(256) for _ in range(random.randint(1, 80))] for _ in range(12)]
    kw = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 32, "dtype": torch.bfloat16}
    gpu = LLM(checkpoint, executor="gpu", decode_iterations=8, **kw)
    outs = [o.outputs[0].token_ids for o in gpu.generate(prompts, greedy(24), use_tqdm=False)]
    single = LLM(checkpoint, executor="eager", **kw)  # single steps: a launch each
    single.generate(prompts, greedy(24), use_tqdm=False)
    stats = teacher_forced_agreement(gpu.model, prompts, outs)
    assert stats["decisive_share"] >= 0.25 and stats["top1_decisive"] >= 0.99, stats
    assert gpu.blocks.num_free == gpu.blocks.num_pages
    assert gpu.stats().launches_per_token < 0.5 * single.stats().launches_per_token


def test_default_model_text_with_bursts():
    """The default model's greedy continuation with bursts of 8 on the GPU: text, and every
    token the float32 model is decisive about is its choice (teacher-forced)."""
    try:
        default_model_path()
    except MpkError as e:
        pytest.skip(str(e))
    kw = {"max_num_seqs": 2, "max_model_len": 256, "max_num_batched_tokens": 64, "dtype": torch.bfloat16}
    gpu = LLM(None, executor="gpu", decode_iterations=8, **kw)
    out = gpu.generate(["The capital of France is"], greedy(32), use_tqdm=False)[0]
    stats = teacher_forced_agreement(gpu.model, [out.prompt_token_ids], [out.outputs[0].token_ids])
    assert out.outputs[0].text.strip() and stats["top1_decisive"] == 1.0, (out.outputs[0].text, stats)
