"""Greedy decoding with a Llama/Qwen3 model compiled by mpk: one megakernel launch per step.

    python examples/decode.py --model path/to/hf-checkpoint --prompt "The capital of France is" --steps 32
    python examples/decode.py --model path/to/hf-checkpoint --prompt-ids 1 2 3 --steps 32 --chunk 2
    python examples/decode.py --random qwen3-tiny --steps 16       # random weights, no download

``--model`` takes a local Hugging Face directory (config.json + *.safetensors, Llama or Qwen3
family). ``--prompt`` tokenizes text with the checkpoint's own tokenizer (transformers'
``AutoTokenizer``, local files only) and prints the completion as text. With ``--model``
generation stops at an end-of-sequence id: those the checkpoint's generation_config.json
names, and with ``--prompt`` the tokenizer's. The prompt is prefilled in one step (``--chunk N``:
steps of at most N tokens), a graph compiled for that many tokens (``mpk.llm.TokenBuckets``);
then each arg-max token is appended by a decode step, a second graph. Prints the generated ids,
the compile, prefill and mean decode step times; ``--check`` also runs mpk's eager path on the
same tokens and reports the largest logit difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mpk.cli import count, page_size
from mpk.engine.loading import eos_ids
from mpk.errors import MpkError
from mpk.llm import DecoderLM, LLMConfig, PagedKVCache, TokenBuckets, load_pretrained, prefill

RANDOM = {
    "qwen3-tiny": LLMConfig(family="qwen3", hidden=256, inter=512, layers=2, heads=8, kv_heads=2, head_dim=64,
                            vocab=1000, tied=True, eps=1e-6, rope_theta=1e6, max_position=4096),
    "llama-tiny": LLMConfig(family="llama", hidden=256, inter=512, layers=2, heads=8, kv_heads=2, head_dim=64,
                            vocab=1000, tied=True, eps=1e-5, rope_theta=5e5, max_position=4096),
}


# files a transformers tokenizer loads from (one suffices: vocab.json + merges.txt alone make a BPE one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local HF checkpoint directory")
    src.add_argument("--random", choices=sorted(RANDOM), help="a random-weight model")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 2, 3, 4])
    prompt.add_argument("--prompt", help="text, tokenized by the checkpoint's tokenizer (needs --model)")
    ap.add_argument("--steps", type=count(1), default=16, help="tokens to generate")
    ap.add_argument("--chunk", type=count(1), default=None,
                    help="prefill the prompt in steps of at most this many tokens (default: all in one step)")
    ap.add_argument("--page-size", type=page_size, default=16)
    ap.add_argument("--executor", choices=["gpu", "cpu"], default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check", action="store_true", help="compare each step with mpk's eager path")
    args = ap.parse_args(argv)
    if args.executor == "gpu" and not torch.cuda.is_available():
        ap.error("--executor gpu: this machine has no CUDA device; use --executor cpu")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: expected a checkpoint directory holding config.json and *.safetensors")
    try:
        return _run(args, ap)
    except MpkError as e:  # mpk's own errors name what is wrong: no traceback needed
        raise SystemExit(f"{type(e).__name__}: {e}") from None


def _run(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    device = "cuda" if args.executor == "gpu" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer, eos = None, set()
    if args.prompt is not None:
        if not args.model:
            ap.error("--prompt needs --model: the text is tokenized by the checkpoint's tokenizer")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            ap.error("--prompt needs transformers (pip install transformers) for the checkpoint's tokenizer")
        if not any((Path(args.model) / f).is_file() for f in TOKENIZER_FILES):
            ap.error(f"--prompt: {args.model} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                     "pass token ids with --prompt-ids instead")
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except (OSError, ValueError, ImportError) as e:  # e.g. a sentencepiece model without sentencepiece
            ap.error(f"--prompt: the tokenizer in {args.model} does not load: {e}")
        args.prompt_ids = tokenizer(args.prompt)["input_ids"]
        if not args.prompt_ids:
            ap.error(f"--prompt {args.prompt!r} tokenizes to no tokens")
    if args.model:
        eos = eos_ids(args.model, tokenizer.eos_token_id if tokenizer is not None else None)
    max_len = len(args.prompt_ids) + args.steps
    if args.model:
        model = load_pretrained(args.model, dtype, device, max_len=max_len)
    else:
        model = DecoderLM(RANDOM[args.random], dtype, device, max_len=max_len).randomize(seed=0, scale=0.1)
    bad = [t for t in args.prompt_ids if not 0 <= t < model.cfg.vocab]
    if bad:
        raise SystemExit(f"prompt ids {bad} are outside the vocabulary [0, {model.cfg.vocab})")
    prompt = list(args.prompt_ids)
    bucket = min(args.chunk or len(prompt), len(prompt))  # the prefill graph's rows: one (padded) chunk
    steps = TokenBuckets(model, PagedKVCache(model, 1, max_len, args.page_size), buckets=[bucket],
                         options={"executor": args.executor})
    ref = TokenBuckets(model, PagedKVCache(model, 1, max_len, args.page_size), buckets=[bucket], eager=True) \
        if args.check else None
    report = steps.compile()
    generated, times, worst, shown = [], [], 0.0, ""

    def difference(logits: torch.Tensor, expected: torch.Tensor) -> float:
        return float((logits.float() - expected.float()).abs().max() / expected.float().abs().max())

    with torch.no_grad():
        start = time.perf_counter()
        logits = prefill(steps, [prompt], args.chunk)[0]
        nxt = int(logits.argmax(-1))
        prefill_s = time.perf_counter() - start
        if ref is not None:
            worst = difference(logits, prefill(ref, [prompt], args.chunk)[0])
        # a progress bar on a terminal where no text streams (token ids: nothing shows until the end)
        for i in tqdm(range(args.steps), desc="decoding", unit="step", leave=False,
                      disable=True if tokenizer is not None else None):
            if i:  # the token generated last goes in; the first came from the prefill
                start = time.perf_counter()
                logits = steps.step([[generated[-1]]])[0]
                nxt = int(logits.argmax(-1))
                times.append(time.perf_counter() - start)
                if ref is not None:
                    worst = max(worst, difference(logits, ref.step([[generated[-1]]])[0]))
            generated.append(nxt)
            if tokenizer is not None:  # the text so far, as it grows
                text = tokenizer.decode(generated, skip_special_tokens=True)
                print(text[len(shown):], end="", flush=True, file=sys.stderr)
                shown = text
            if nxt in eos:
                break
    if tokenizer is not None:
        print(file=sys.stderr)
    print(f"generated ids: {generated}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(args.prompt_ids + generated, skip_special_tokens=True)}")
    steps_done = -(-len(prompt) // bucket)
    print(f"compile: {report}")
    print(f"prefill: {len(prompt)} token(s) in {steps_done} step(s), {prefill_s:.2f} s")
    if times:
        warm = f", {1e3 * sum(times[1:]) / (len(times) - 1):.2f} ms/step after the first" if len(times) > 1 else ""
        print(f"decode: {len(times)} step(s){warm} (first: {1e3 * times[0]:.1f} ms)")
    if args.check:
        print(f"largest logit difference vs mpk eager, relative to max |logit|: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
