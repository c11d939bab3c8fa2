"""The engine's host cost per step outside the model, on the CPU: ``mpk.LLM`` over a tiny random
Qwen3 (eager PyTorch steps) generating for ``--seqs`` concurrent requests, each step's wall time
minus the time of its model call (``TokenBuckets.run``). What is left is what the engine adds
to every step on any device: scheduling, the page table, sampling, the host copy of the ids,
appending and detokenising.

Two cases per sampling mix: the byte tokenizer (vocab 260, detokenised) and no tokenizer over
Qwen3's vocabulary (151,936: the sampler's cost at full width, nothing detokenised). Mixes:
"greedy" (temperature 0) and "sampled" (temperature 1, top-k 50, top-p 0.9). Prints one JSON
line per case (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row  # noqa: E402

from mpk import LLM, SamplingParams  # noqa: E402
from mpk.cli import count  # noqa: E402
from mpk.llm import DecoderLM  # noqa: E402
from mpk.testing.decode import small_config  # noqa: E402
from mpk.testing.engine import VOCAB, byte_tokenizer  # noqa: E402

MIXES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_k=50, top_p=0.9)}
QWEN3_VOCAB = 151936


def step_overheads(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[float]]:
    """(wall ms, model ms) of each decode step (every sequence decoding) of ``generate``."""
    buckets = llm.runner.buckets
    run, model_ms = buckets.run, []

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        out = run(*a, **k)
        model_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    wall_ms, steps = [], llm._steps

    def timed_steps():
        last = time.perf_counter()
        for changed in steps():  # yield to yield: the consumer's work per step counts too
            now = time.perf_counter()
            wall_ms.append((now - last) * 1e3)
            last = now
            yield changed

    buckets.run, llm._steps = timed_run, timed_steps
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del buckets.run, llm._steps
    decode = slice(1, -1)  # the first step prefills; the last retires every sequence
    return wall_ms[decode], model_ms[decode]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seqs", type=count(1), default=64, help="concurrent requests")
    ap.add_argument("--prompt-len", type=count(1), default=16, help="tokens per prompt")
    ap.add_argument("--output-len", type=count(2), default=64, help="tokens generated per request")
    ap.add_argument("--threads", type=count(1), default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for case, vocab, tokenizer in (("bytes", VOCAB, byte_tokenizer()), ("qwen3-vocab", QWEN3_VOCAB, None)):
        cfg = small_config("qwen3", vocab=vocab, max_position=args.prompt_len + args.output_len)
        model = DecoderLM(cfg, torch.float32, "cpu").randomize(seed=0)
        llm = LLM.from_model(model, tokenizer, max_num_seqs=args.seqs, max_model_len=cfg.max_position,
                             max_num_batched_tokens=args.seqs * args.prompt_len, buckets=[args.seqs * args.prompt_len])
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.seqs)]
        for mix, kw in MIXES.items():
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=1, **kw)
            wall, model_ms = step_overheads(llm, prompts, params)
            host = [w - m for w, m in zip(wall, model_ms)]
            row = {"case": case, "vocab": vocab, "mix": mix, "seqs": args.seqs, "steps": len(host),
                   "step_ms": statistics.median(wall), "model_ms": statistics.median(model_ms),
                   "host_ms": statistics.median(host)}
            emit_row(row, args.out)
            rows.append(row)
    print(f"\n{'case':12s} {'mix':8s} {'seqs':>4s} {'step ms':>8s} {'model ms':>8s} {'host ms':>8s}")
    for r in rows:
        print(f"{r['case']:12s} {r['mix']:8s} {r['seqs']:4d} {r['step_ms']:8.3f} {r['model_ms']:8.3f} "
              f"{r['host_ms']:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
