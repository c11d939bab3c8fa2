"""Generation throughput of ``mpk.LLM`` against Hugging Face ``generate`` and a gpt-fast-style
loop, in one run on one device (random weights; the seed paper's workload).

For each model shape and concurrency c: c requests of ``--prompt-len`` random tokens, each
generating ``--output-len`` tokens greedily (``ignore_eos``), submitted together to an engine
(``LLM.from_model``) of ``max_num_seqs`` c whose one prefill bucket holds all c prompts: two
graphs per configuration, the c·prompt-len-row step and the decode form (``--prebuild`` traces
them and builds their kernels into ``$MPK_CACHE_DIR`` on a machine without a GPU, so the GPU run
skips nvcc). Times, wall clock around ``generate`` (synchronised): the whole run, and the run
cut to one token (the prefill step); the decode phase is their difference, TPOT = decode phase /
(output-len − 1). The bare decode step is the engine's own decode graph (``TokenBuckets.run``,
decode form, same batch) timed back to back by CUDA events at four positions spread over the
decode phase (their mean: attention's cost grows linearly with the position); ``tpot_overhead``
= TPOT / bare step − 1 is what the engine's host loop adds (target ≤ 3% at c = 1). Launches per
token: the CUDA kernels and copies a short ``generate`` issues (torch.profiler), per token;
host launches per token: the engine's own count (``LLM.stats``: a step, or a burst, is one).

``--decode-iterations k`` (> 1) also runs, in the same run, an engine of ``decode_iterations=k``
(k decode iterations per launch: ``mpk.llm.multistep``) on the same prompts: its tok/s, TPOT and
launches per token appear beside the single-step engine's as ``multistep_*`` (``--prebuild``
then builds its multi-step graphs too, one per batch size 1, 2, 4, … c).

Peers, at the same c: the gpt-fast-style loop (``peer.PeerDecoder``: its prefill, then one
CUDA graph per token of ``torch.compile``'d step + greedy argmax + position increment, replayed
back to back; torch.compile's automatic dynamic shapes make it two compiles per model across
the concurrencies), and Hugging Face ``generate`` (``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` of
the shape, random bf16, ``cache_implementation="static"``, which transformers compiles itself,
fullgraph with CUDA graphs; one compile per concurrency). A peer that fails records its error in
the row. The floor: (weights + the KV cache at the mean decode position) / measured copy
bandwidth, per decode step; ``floor_util`` = floor / step time.

Prints one JSON line per configuration (also appended to ``--out``) and a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import emit_row, peer_shape  # noqa: E402
from peer import (PeerDecoder, Shape, _capture, _error, copy_bandwidth, floor_ms, kv_bytes, require_cuda,  # noqa: E402
                  time_step, weight_bytes)

from mpk import LLM, SamplingParams  # noqa: E402
from mpk.cli import count  # noqa: E402
from mpk.cli import page_size as page_size_arg  # noqa: E402
from mpk.llm import SHAPES as MODELS  # noqa: E402
from mpk.llm import DecoderLM, LLMConfig  # noqa: E402

BARE_POSITIONS = 4


def engine_options(c: int, prompt_len: int, output_len: int, page_size: int, decode_iterations: int = 1) -> dict:
    """The engine of concurrency ``c``: c sequences, one prefill bucket of every prompt (with
    the decode form, two graphs; with ``decode_iterations`` > 1 the multi-step graphs too), a
    page pool of exactly c sequences (the cache's shape is part of the graphs: the prebuild and
    the run must agree)."""
    max_len = prompt_len + output_len
    return dict(max_num_seqs=c, max_model_len=max_len, max_num_batched_tokens=c * prompt_len,
                buckets=[c * prompt_len], page_size=page_size, num_pages=c * -(-max_len // page_size),
                executor="gpu", decode_iterations=decode_iterations)


def model_config(name: str, layers: int | None) -> LLMConfig:
    cfg = MODELS[name]
    return cfg if layers is None else replace(cfg, layers=layers)


def timed(fn: Callable[[], object]) -> float:
    """Seconds of ``fn()``, the device drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def launches(fn: Callable[[], object]) -> dict:
    """The CUDA kernels and memory copies/sets ``fn()`` issues (torch.profiler's device
    activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(n.lower().startswith(("memcpy", "memset")) for n in names)
    return {"kernels": len(names) - copies, "copies": copies}


def bench_engine(model: DecoderLM, c: int, args, decode_iterations: int = 1) -> dict:
    """The engine's run at concurrency ``c`` (see the module); with ``decode_iterations`` > 1
    the multi-step engine's, its keys prefixed ``multistep_`` and without the bare step."""
    llm = LLM.from_model(model, **engine_options(c, args.prompt_len, args.output_len, args.page_size,
                                                 decode_iterations))
    report = llm.runner.compile(progress=args.progress)
    print(f"  c={c}{f' decode_iterations={decode_iterations}' if decode_iterations > 1 else ''}: {report}",
          flush=True)
    if args.prebuild:
        return {}
    g = torch.Generator().manual_seed(c)
    prompts = [torch.randint(0, model.cfg.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(c)]

    def run(tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if any(len(o.outputs[0].token_ids) != tokens for o in outs):
            raise RuntimeError(f"c={c}: a request stopped before {tokens} tokens")

    run(8)  # warm-up: the first launches load the kernels and bind their arguments
    prefill_s = statistics.median(timed(lambda: run(1)) for _ in range(3))
    before = (llm.stats().launches, llm.stats().tokens)
    total_s = timed(lambda: run(args.output_len))
    host_lpt = (llm.stats().launches - before[0]) / (llm.stats().tokens - before[1])
    decode_s = total_s - prefill_s
    tpot_ms = decode_s / (args.output_len - 1) * 1e3
    count_tokens = 16
    issued = launches(lambda: run(count_tokens))
    measured = {"tok_s": c * args.output_len / total_s, "decode_tok_s": c * (args.output_len - 1) / decode_s,
                "tpot_ms": tpot_ms, "host_launches_per_token": host_lpt,
                "launches_per_token": {k: v / (c * count_tokens) for k, v in issued.items()}}
    if decode_iterations > 1:
        result = {f"multistep_{k}": v for k, v in measured.items()} | {"decode_iterations": decode_iterations}
    else:
        # the engine's decode graph alone, at positions spread over the decode phase
        runner, pps = llm.runner, -(-(args.prompt_len + args.output_len) // args.page_size)
        bare = []
        for i in range(BARE_POSITIONS):
            pos = args.prompt_len + int((i + 0.5) / BARE_POSITIONS * (args.output_len - 1))
            runner.table.write([list(range(b * pps, (b + 1) * pps)) for b in range(c)], [pos + 1] * c, [1] * c)
            tokens = [0] * c
            bare.append(time_step(lambda: runner.buckets.run(tokens, [1] * c)))
        bare_ms = statistics.mean(bare)
        result = measured | {"graphs": len(report.trace_s), "compile_s": report.total_s, "prefill_ms": prefill_s * 1e3,
                             "total_s": total_s, "bare_step_ms": bare_ms, "bare_steps_ms": bare,
                             "tpot_overhead": tpot_ms / bare_ms - 1,
                             "launches_per_step": {k: v / count_tokens for k, v in issued.items()}}
    del llm
    gc.collect()
    return result


def bench_gptfast(shape: Shape, c: int, args, compiled: Callable) -> dict:
    """The gpt-fast-style loop at concurrency ``c``: prefill, then a CUDA graph per token (the
    compiled step, greedy argmax into the token buffer, the position advanced) replayed
    ``output-len`` − 1 times back to back."""
    max_len = -(-(args.prompt_len + args.output_len) // 16) * 16
    model = PeerDecoder(shape, c, max_len, "cuda").eval()
    try:
        g = torch.Generator(device="cuda").manual_seed(c)
        prompt = torch.randint(0, shape.vocab, (c, args.prompt_len), device="cuda", generator=g)
        last = torch.full((c,), args.prompt_len - 1, device="cuda")
        tok = torch.zeros(c, dtype=torch.long, device="cuda")
        pos = torch.zeros(1, dtype=torch.long, device="cuda")

        def step() -> torch.Tensor:
            tok.copy_(compiled(model, tok, pos).argmax(-1))
            pos.add_(1)
            return tok

        with torch.no_grad():
            graph, _ = _capture(step)

            def generate() -> None:
                tok.copy_(model.prefill(prompt, last).argmax(-1))
                pos.fill_(args.prompt_len)
                for _ in range(args.output_len - 1):
                    graph.replay()

            generate()  # warm-up
            prefill_s = timed(lambda: (tok.copy_(model.prefill(prompt, last).argmax(-1))))
            total_s = timed(generate)
        decode_s = total_s - prefill_s
        return {"gptfast_tok_s": c * args.output_len / total_s, "gptfast_tpot_ms": decode_s / (args.output_len - 1) * 1e3}
    except Exception as e:  # noqa: BLE001 - a failed peer is reported, not fatal
        return {"gptfast_tok_s": None, "gptfast_tpot_ms": None, "gptfast_error": _error(e)}
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def hf_model(name: str, layers: int | None):
    """The transformers model of the shape ``name`` (random bf16 on the GPU)."""
    import transformers

    cfg = model_config(name, layers)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()


def bench_hf(hf, c: int, vocab: int, args) -> dict:
    """Hugging Face ``generate`` at concurrency ``c`` with its static cache (compiled by
    transformers: ``cache_implementation="static"``), greedy, exactly ``output-len`` tokens."""
    try:
        g = torch.Generator(device="cuda").manual_seed(c)
        ids = torch.randint(0, vocab, (c, args.prompt_len), device="cuda", generator=g)
        mask = torch.ones_like(ids)

        def run(tokens: int) -> None:
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, cache_implementation="static", pad_token_id=0)
            if out.shape[1] != args.prompt_len + tokens:
                raise RuntimeError(f"generate returned {out.shape[1] - args.prompt_len} tokens; expected {tokens}")

        with torch.no_grad():
            run(args.output_len)  # compiles, records its CUDA graphs
            prefill_s = timed(lambda: run(1))
            total_s = timed(lambda: run(args.output_len))
        return {"hf_tok_s": c * args.output_len / total_s,
                "hf_tpot_ms": (total_s - prefill_s) / (args.output_len - 1) * 1e3}
    except Exception as e:  # noqa: BLE001
        return {"hf_tok_s": None, "hf_tpot_ms": None, "hf_error": _error(e)}


def bench_model(name: str, args, bandwidth: float | None) -> list[dict]:
    cfg = model_config(name, args.layers)
    max_len = args.prompt_len + args.output_len
    if args.prebuild:
        model = DecoderLM(cfg, torch.bfloat16, "cpu", max_len=max_len)
    else:
        model = DecoderLM(cfg, torch.bfloat16, "cuda", max_len=max_len)
        torch.manual_seed(0)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.normal_(1.0 if "norm" in pname else 0.0, 0.02)
    shape = replace(peer_shape(name), layers=cfg.layers)
    rows = []
    engine = {c: bench_engine(model, c, args) | (bench_engine(model, c, args, args.decode_iterations)
                                                  if args.decode_iterations > 1 else {})
              for c in args.concurrency}
    torch._dynamo.reset()
    del model
    gc.collect()
    if args.prebuild:
        return []
    torch.cuda.empty_cache()
    peers = {c: {} for c in args.concurrency}
    if not args.skip_peers:
        compiled = torch.compile(lambda m, t, p: m(t, p), mode=args.compile_mode, fullgraph=True)
        for c in args.concurrency:
            peers[c] |= bench_gptfast(shape, c, args, compiled)
        torch._dynamo.reset()
        hf = hf_model(name, args.layers)
        for c in args.concurrency:
            peers[c] |= bench_hf(hf, c, cfg.vocab, args)
            torch._dynamo.reset()  # each batch's compiled forward and CUDA graphs, dropped
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    mean_pos = args.prompt_len + args.output_len // 2
    for c in args.concurrency:
        e, p = engine[c], peers[c]
        floor = floor_ms(weight_bytes(shape) + kv_bytes(shape, c, mean_pos), bandwidth)
        best = max((v for v in (p.get("gptfast_tok_s"), p.get("hf_tok_s")) if v), default=None)
        row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "model": name,
               "layers": cfg.layers, "concurrency": c, "prompt_len": args.prompt_len, "output_len": args.output_len,
               "page_size": args.page_size, **e, **p, "best_peer_tok_s": best,
               "speedup": e["tok_s"] / best if best else None, "floor_ms": floor,
               "floor_util": floor / e["tpot_ms"], "bare_floor_util": floor / e["bare_step_ms"],
               "gptfast_floor_util": floor / p["gptfast_tpot_ms"] if p.get("gptfast_tpot_ms") else None,
               "hf_floor_util": floor / p["hf_tpot_ms"] if p.get("hf_tpot_ms") else None,
               "bandwidth_GBps": bandwidth / 1e9}
        emit_row(row, args.out)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama3.2-1b", "qwen3-1.7b", "qwen3-8b"],
                    choices=sorted(MODELS), metavar="MODEL", help=f"any of {', '.join(sorted(MODELS))}")
    ap.add_argument("--concurrency", nargs="+", type=count(1), default=[1, 4, 16, 64], help="concurrent requests")
    ap.add_argument("--prompt-len", type=count(1), default=64, help="tokens per prompt")
    ap.add_argument("--output-len", type=count(2), default=1024, help="tokens generated per request")
    ap.add_argument("--page-size", type=page_size_arg, default=16, help="KV-cache page size")
    ap.add_argument("--layers", type=count(1), default=None,
                    help="cut the models to this many layers (quick checks; default: the full models)")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode of the gpt-fast loop's step")
    ap.add_argument("--skip-peers", action="store_true", help="the engine alone")
    ap.add_argument("--decode-iterations", type=count(1), default=1,
                    help="also run an engine of this many decode iterations per launch (> 1) beside the single-step "
                         "one")
    ap.add_argument("--prebuild", action="store_true",
                    help="trace the engines' graphs and build their kernels into $MPK_CACHE_DIR (no GPU needed), "
                         "time nothing")
    ap.add_argument("--progress", action="store_true", help="progress bars while tracing and building")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    if not args.prebuild:
        require_cuda("generate_throughput.py", "--prebuild builds its kernels without one")
    bandwidth = None if args.prebuild else copy_bandwidth()
    if bandwidth:
        print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = [r for name in args.models for r in bench_model(name, args, bandwidth)]
    if args.prebuild:
        return 0

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    print(f"\n{'model':12s} {'c':>3s} {'mpk tok/s':>10s} {'gptfast':>9s} {'hf':>9s} {'speedup':>8s} {'TPOT ms':>8s} "
          f"{'bare ms':>8s} {'overhead':>8s} {'floor ms':>8s} {'util':>5s} {'launch/tok':>10s} {'host/tok':>8s}"
          + (f" {'ms tok/s':>9s} {'ms TPOT':>8s} {'ms host/tok':>11s}" if args.decode_iterations > 1 else ""))
    for r in rows:
        lpt = r["launches_per_token"]
        print(f"{r['model']:12s} {r['concurrency']:3d} {r['tok_s']:10.0f} {fmt(r.get('gptfast_tok_s'), '9.0f')} "
              f"{fmt(r.get('hf_tok_s'), '9.0f')} {fmt(r['speedup'], '7.2f')}x {r['tpot_ms']:8.3f} "
              f"{r['bare_step_ms']:8.3f} {r['tpot_overhead']:8.1%} {r['floor_ms']:8.3f} {r['floor_util']:5.2f} "
              f"{lpt['kernels'] + lpt['copies']:10.2f} {r['host_launches_per_token']:8.3f}"
              + (f" {r['multistep_tok_s']:9.0f} {r['multistep_tpot_ms']:8.3f} "
                 f"{r['multistep_host_launches_per_token']:11.3f}" if args.decode_iterations > 1 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
