"""The engine's ``mpk`` subcommands: ``generate`` (prompts or a JSONL file → JSONL), ``chat``
(an interactive loop through the chat template, streaming), ``serve`` (the OpenAI-compatible
server, ``mpk.serve``) and ``bench latency|throughput|serve`` (JSON lines)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any, Callable, TextIO

from mpk.engine.stats import percentile
from mpk.errors import MpkError


def _engine_flags(p: argparse.ArgumentParser, count: Callable[[int], Callable[[str], int]],
                  page_size: Callable[[str], int], max_model_len: int | None = 4096) -> None:
    p.add_argument("--model", help="a Hugging Face directory or a .gguf file (default: mpk's default model)")
    p.add_argument("--max-model-len", type=count(2), default=max_model_len,
                   help="tokens per sequence at most (default " + (
                       "%(default)s)" if max_model_len else "the input and output lengths' sum)"))
    p.add_argument("--max-num-seqs", type=count(1), default=64, help="sequences per step (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=count(1), default=512,
                   help="new tokens per step (default %(default)s)")
    p.add_argument("--page-size", type=page_size, default=16, help="tokens per KV page (default %(default)s)")
    p.add_argument("--num-pages", type=count(1), help="KV pages in the pool (default: what max-num-seqs sequences "
                   "of max-model-len need, within the device's free memory)")
    p.add_argument("--executor", choices=("gpu", "cpu", "eager"),
                   help="gpu (default on CUDA), eager (default on the CPU) or cpu (mpk's interpreter)")
    p.add_argument("--seed", type=count(0), default=0,
                   help="the engine's seed, from which each request's sampling seed derives (default %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV pages of equal prefixes")
    p.add_argument("--decode-iterations", type=count(1), default=None,
                   help="decode iterations per launch when every running sequence decodes (default: 8 on one GPU, "
                        "else 1)")
    p.add_argument("--tensor-parallel-size", type=count(1), default=1,
                   help="GPUs the model is sharded over, one rank each; the command starts ranks 1…N-1 itself "
                        "(default %(default)s)")


def _sampling_flags(p: argparse.ArgumentParser, count: Callable[[int], Callable[[str], int]]) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=count(1), default=256, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--stop", action="append", help="a string that ends the output (repeatable)")


def _llm(ns: argparse.Namespace, max_model_len: int | None = None):
    from mpk.engine.llm import LLM

    return LLM(ns.model, max_num_seqs=ns.max_num_seqs, max_model_len=max_model_len or ns.max_model_len,
               page_size=ns.page_size, executor=ns.executor, max_num_batched_tokens=ns.max_num_batched_tokens,
               num_pages=ns.num_pages, seed=ns.seed, enable_prefix_caching=not ns.no_prefix_caching,
               tensor_parallel_size=ns.tensor_parallel_size, decode_iterations=ns.decode_iterations)


def _params(ns: argparse.Namespace):
    from mpk.engine.sampling import SamplingParams

    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                          max_tokens=ns.max_tokens, stop=ns.stop).validate()


def _read_requests(path: str) -> list[dict[str, Any]]:
    """The lines of a JSONL file, each an object with "prompt" (text or token ids) or
    "messages" (a conversation)."""
    requests = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise MpkError(f"{path}:{n} is not JSON ({e})") from None
            if not isinstance(doc, dict) or ("prompt" in doc) == ("messages" in doc):
                raise MpkError(f"{path}:{n}: expected an object with \"prompt\" or \"messages\" (one of them)")
            requests.append(doc)
    return requests


def _record(out) -> dict[str, Any]:
    c = out.outputs[0]
    return {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "num_prompt_tokens": len(out.prompt_token_ids), "error": out.error}


def cmd_generate(ns: argparse.Namespace) -> int:
    if bool(ns.prompt) == bool(ns.input):
        raise MpkError("expected --prompt (repeatable) or --input FILE.jsonl, one of them")
    requests = _read_requests(ns.input) if ns.input else [{"prompt": p} for p in ns.prompt]
    params = _params(ns)
    llm = _llm(ns)
    sink: TextIO = open(ns.output, "w") if ns.output else sys.stdout
    try:
        if len(requests) == 1 and not ns.output and sys.stdout.isatty():  # one prompt on a terminal: stream it
            req = requests[0]
            final = None
            for piece in llm.stream([req["messages"]] if "messages" in req else [req["prompt"]], params,
                                    chat="messages" in req):
                print(piece.outputs[0].text, end="", flush=True)
                final = piece
            print()
            return 1 if final is not None and final.error else 0
        plain = [i for i, r in enumerate(requests) if "prompt" in r]
        chats = [i for i, r in enumerate(requests) if "messages" in r]
        results: dict[int, Any] = {}
        if plain:
            results |= dict(zip(plain, llm.generate([requests[i]["prompt"] for i in plain], params)))
        if chats:
            results |= dict(zip(chats, llm.chat([requests[i]["messages"] for i in chats], params)))
        for i in range(len(requests)):
            sink.write(json.dumps(_record(results[i])) + "\n")
        return 1 if any(r.error for r in results.values()) else 0
    finally:
        if sink is not sys.stdout:
            sink.close()


def cmd_chat(ns: argparse.Namespace) -> int:
    params, llm = _params(ns), _llm(ns)
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("mpk chat: an empty line or Ctrl-D quits; Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = ""
        try:
            for piece in llm.stream([messages], params, chat=True):
                if piece.error:
                    raise MpkError(piece.error)
                reply += piece.outputs[0].text
                print(piece.outputs[0].text, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(ns: argparse.Namespace) -> int:
    from mpk.serve.server import cmd_serve as serve

    return serve(ns)


def cmd_bench(ns: argparse.Namespace) -> int:
    if ns.kind == "serve":
        from mpk.serve.bench import bench_serve

        return bench_serve(ns)
    from tqdm import tqdm

    from mpk.engine.sampling import SamplingParams

    llm = _llm(ns, ns.max_model_len or ns.input_len + ns.output_len)
    llm.compile()  # every graph before the clock starts: nothing timed waits for a trace
    rng = random.Random(ns.seed)
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(llm.vocab) for _ in range(ns.input_len)] for _ in range(n)]

    common = {"bench": ns.kind, "input_len": ns.input_len, "output_len": ns.output_len}
    if ns.kind == "latency":
        ttft, tpot = [], []
        llm.generate(prompts(ns.batch_size), SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm
        for _ in tqdm(range(ns.iters), desc="latency", unit="iter"):
            start = time.perf_counter()
            last: dict[int, float] = {}
            for piece in llm.stream(prompts(ns.batch_size), params):
                now = time.perf_counter()
                if piece.request_id not in last:
                    ttft.append(now - start)
                elif piece.outputs[0].token_ids:
                    tpot.append((now - last[piece.request_id]) / len(piece.outputs[0].token_ids))
                last[piece.request_id] = now
        doc = common | {"batch_size": ns.batch_size, "iters": ns.iters,
                        **{f"{k}_p{q}_ms": 1e3 * percentile(v, q) for k, v in (("ttft", ttft), ("tpot", tpot))
                           for q in (50, 99)}}
    else:
        reqs = prompts(ns.num_requests)
        start = time.perf_counter()
        outs = llm.generate(reqs, params)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        doc = common | {"num_requests": ns.num_requests, "seconds": elapsed,
                        "requests_per_s": ns.num_requests / elapsed,
                        "output_tokens_per_s": produced / elapsed,
                        "total_tokens_per_s": (produced + ns.num_requests * ns.input_len) / elapsed,
                        "preemptions": llm.num_preemptions}
    print(json.dumps(doc))
    return 0


def add_commands(sub: argparse._SubParsersAction, count: Callable[[int], Callable[[str], int]],
                 page_size: Callable[[str], int]) -> None:
    """Register generate, chat, serve and bench (``count`` and ``page_size``: mpk.cli's argparse types)."""
    p = sub.add_parser("generate", help="generate for prompts (--prompt or --input JSONL) → JSONL")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--input", help="a JSONL file: one object per line with \"prompt\" or \"messages\"")
    p.add_argument("--output", help="the JSONL results' file (default: stdout)")
    _engine_flags(p, count, page_size)
    _sampling_flags(p, count)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="an interactive chat through the model's chat template, streamed")
    p.add_argument("--system", help="a system message")
    _engine_flags(p, count, page_size)
    _sampling_flags(p, count)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health, /metrics)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=count(1), default=8000, help="port (default %(default)s)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model file's stem or "
                                               "directory's name)")
    p.add_argument("--api-key", help="answer 401 to requests without `Authorization: Bearer KEY`")
    p.add_argument("--max-queue", type=count(0), default=256,
                   help="requests that may wait beyond --max-num-seqs running; more get 429 (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default %(default)s)")
    _engine_flags(p, count, page_size)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("bench", help="latency (TTFT, TPOT) or throughput (tokens/s) of generation, or serve: a "
                                     "request sweep against a running `mpk serve`; JSON lines")
    p.add_argument("kind", choices=("latency", "throughput", "serve"))
    p.add_argument("--input-len", type=count(1), default=128, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=count(1), default=128, help="generated tokens (default %(default)s)")
    p.add_argument("--batch-size", type=count(1), default=8, help="latency: requests at once (default %(default)s)")
    p.add_argument("--iters", type=count(1), default=3, help="latency: repetitions (default %(default)s)")
    p.add_argument("--num-requests", type=count(1), default=256, help="throughput: requests (default %(default)s)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="serve: the server (default %(default)s)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=count(1), nargs="+",
                      help="serve: sweep requests in flight at once (default 1 4 16 64)")
    load.add_argument("--rates", type=float, nargs="+", help="serve: sweep Poisson arrival rates (requests/s)")
    p.add_argument("--num-prompts", type=count(1), default=64, help="serve: requests per sweep point "
                                                                    "(default %(default)s)")
    p.add_argument("--api-key", help="serve: the server's API key")
    _engine_flags(p, count, page_size, max_model_len=None)
    p.set_defaults(func=cmd_bench)
