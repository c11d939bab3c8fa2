"""``mpk`` command line. ``mpk inspect TARGET`` compiles a model (without running it) and
reports its task graph: per-op task counts, events before/after fusion, dummy-task share,
JIT/AOT counts; it writes the tables, DOT (SVG with graphviz), JSON and a summary. With
``--verify`` it also runs the compiler's happens-before check and prints its result.

TARGET is a preset (see ``mpk inspect --help``) or ``path/to/file.py:factory`` where
``factory()`` returns ``(module, example_args)``.

``mpk generate``, ``mpk chat``, ``mpk serve`` (an OpenAI-compatible server, ``mpk.serve``) and
``mpk bench latency|throughput|serve`` run ``mpk.LLM`` (``mpk.engine.commands``).

``mpk timeline TRACE.json`` draws a profiled launch (the ``profile_dir`` option, or
``GpuExecutor.trace``) as an SVG, one lane per SM, and prints the time per task kind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mpk.errors import MpkError, VerifyError
from mpk.llm import SHAPES
from mpk.ops.paged import PAGE_SIZES, is_page_size


def _preset_decoder(config_name: str, decode: bool, meta: bool) -> Callable[[argparse.Namespace], tuple]:
    def build(ns: argparse.Namespace):
        from dataclasses import replace

        from mpk.testing import toy_models as toy

        cfg = getattr(toy, config_name)
        if ns.layers:
            cfg = replace(cfg, layers=ns.layers)
        device = torch.device("meta") if meta else torch.device("cpu")
        with device:
            model = toy.Decoder(cfg).eval()
            ids = torch.zeros(ns.batch, 1 if decode else ns.seq, dtype=torch.long)
            s = 1 if decode else ns.seq
            cos, sin = torch.ones(s, cfg.head_dim), torch.ones(s, cfg.head_dim)
            past = [torch.ones(ns.batch, cfg.kv_heads, ns.cache_len, cfg.head_dim) for _ in range(2 * cfg.layers)]
        return model, (ids, cos, sin, past) if decode else (ids, cos, sin)
    build.flags = ("layers", "batch", "cache_len" if decode else "seq")  # type: ignore[attr-defined]
    return build


def _preset_paged(shape: str) -> Callable[[argparse.Namespace], tuple]:
    """The decode step of ``mpk.llm.DecoderLM`` for a public model shape, on meta
    tensors: paged cache of --cache-len positions per sequence, page size 16."""
    def build(ns: argparse.Namespace):
        from dataclasses import replace

        from mpk.llm import DecoderLM

        cfg = SHAPES[shape] if not ns.layers else replace(SHAPES[shape], layers=ns.layers)
        page = 16
        pages = ns.batch * -(-ns.cache_len // page)
        with torch.device("meta"):
            model = DecoderLM(cfg, torch.bfloat16, "meta", max_len=ns.cache_len)
            cache = torch.empty(cfg.layers, 2, pages, cfg.kv_heads, page, cfg.head_dim, dtype=torch.bfloat16)
            args = (torch.zeros(ns.batch, dtype=torch.long), cache, torch.zeros(ns.batch + 1, dtype=torch.int32),
                    torch.zeros(pages, dtype=torch.int32), torch.zeros(ns.batch, dtype=torch.int32))
        return model, args
    build.flags = ("layers", "batch", "cache_len")  # type: ignore[attr-defined]
    return build


# the size flags of `mpk inspect` and their defaults; each preset takes some of them (build.flags)
SIZE_FLAGS = {"layers": None, "batch": 1, "seq": 8, "cache_len": 1024}


PRESETS: dict[str, Callable[[argparse.Namespace], tuple]] = {
    "qwen3-8b-decode": _preset_decoder("QWEN3_8B", decode=True, meta=True),
    **{f"{shape}-paged": _preset_paged(shape) for shape in SHAPES},
    "llama-toy": _preset_decoder("LLAMA", decode=False, meta=False),
    "qwen3-toy": _preset_decoder("QWEN3", decode=False, meta=False),
    "qwen3-toy-decode": _preset_decoder("QWEN3", decode=True, meta=False),
}


def _load_factory(target: str) -> Callable[[], tuple]:
    path, _, name = target.rpartition(":")
    if not path or not Path(path).is_file():
        raise SystemExit(f"mpk inspect: {target!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor FILE.py:FACTORY with an existing file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"mpk inspect: {path} has no function {name!r}")
    return getattr(module, name)


def cmd_inspect(ns: argparse.Namespace) -> int:
    from mpk.inspection import compile_module, dump

    if Path(ns.out).exists() and not Path(ns.out).is_dir():
        raise MpkError(f"--out {ns.out} is a file; expected a directory for the dump")
    factory = None if ns.target in PRESETS else _load_factory(ns.target)  # a mistyped target named first
    given = [f for f in SIZE_FLAGS if getattr(ns, f) is not None]
    takes = PRESETS[ns.target].flags if ns.target in PRESETS else ()
    ignored = [f for f in given if f not in takes]
    if ignored:
        flags = ", ".join("--" + f.replace("_", "-") for f in ignored)
        raise MpkError(f"{flags} {'does' if len(ignored) == 1 else 'do'} not apply to {ns.target}: " + (
            f"it takes {', '.join('--' + f.replace('_', '-') for f in takes)}" if takes else
            "a FILE.py:FACTORY target builds its own inputs"))
    for f, default in SIZE_FLAGS.items():
        if getattr(ns, f) is None:
            setattr(ns, f, default)
    if ns.target in PRESETS:
        model, args = PRESETS[ns.target](ns)
    else:
        made = factory()
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
            raise MpkError(f"{ns.target} returned {type(made).__name__}; expected (module, example_args)")
        model, args = made
    options: dict[str, Any] = {"num_workers": ns.workers, "verify": ns.verify}
    if ns.partition:
        options["partition"] = ns.partition
    t0 = time.perf_counter()
    print(f"tracing and compiling {ns.target} …", file=sys.stderr)
    try:
        compiled = compile_module(model, args, options)
    except VerifyError as e:
        print(f"verify: FAILED: {e}")
        return 1
    print(compiled.stats.summary())
    print(f"total (trace + compile): {time.perf_counter() - t0:.2f} s")
    paths = dump(compiled, ns.out, ns.target.replace("/", "_").replace(":", "_").replace(".py", ""))
    for kind, p in paths.items():
        print(f"{kind:8s} {p}")
    return 0


def cmd_timeline(ns: argparse.Namespace) -> int:
    from mpk.executors.timeline import breakdown, load_trace, timeline_svg

    out = ns.out or str(Path(ns.trace).with_suffix(".svg"))
    if Path(out).is_dir():
        raise MpkError(f"--out {out} is a directory; expected an SVG file path")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": load_trace(ns.trace)}  # read once: a full-size step's trace is MBs
    timeline_svg(doc, out, start_us=ns.start_us, end_us=ns.end_us, title=ns.title or Path(ns.trace).stem)
    summary = breakdown(doc)
    total = summary["profiled_step_us"]
    if ns.start_us is not None or ns.end_us is not None:
        print("(the window limits the drawing; the times below are the whole launch's)")
    for kind, us in summary.items():
        if isinstance(us, float) and kind != "profiled_step_us":
            extra = (f"  {summary['tasks'][kind]:5d} tasks, median {summary['median_task_us'][kind]:6.2f} µs"
                     if kind in summary["tasks"] else "")
            print(f"{kind:20s} {us:9.1f} µs {us / total:6.1%}{extra}")
    print(f"{'launch':20s} {total:9.1f} µs")
    print(f"svg      {out}")
    return 0


def count(least: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer ≥ ``least`` (shared with the examples and benchmarks)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {least}")
        return value
    return parse


def page_size(text: str) -> int:
    """An argparse type: a KV-cache page size (``mpk.ops.paged.PAGE_SIZES``)."""
    value = count(1)(text)
    if not is_page_size(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {PAGE_SIZES}")
    return value


def json_object(text: str) -> dict:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object, e.g. '{{\"matmul\": {{\"-1\": 64}}}}'")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpk", description="mpk: mega-kernel compiler for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="compile a model and report its task graph")
    p.add_argument("target", help=f"preset ({', '.join(PRESETS)}) or FILE.py:FACTORY")
    p.add_argument("--out", default="mpk-inspect", help="directory for tables/DOT/SVG/JSON (default %(default)s)")
    p.add_argument("--workers", type=count(1), default=128, help="worker count partitioning targets (default 128)")
    p.add_argument("--partition", type=json_object, help='JSON overrides, e.g. \'{"matmul": {"-1": 64}}\'')
    p.add_argument("--layers", type=count(1), help="presets: number of layers")
    p.add_argument("--batch", type=count(1), help="presets: batch size (default 1)")
    p.add_argument("--seq", type=count(1), help="prefill presets (llama-toy, qwen3-toy): sequence length (default 8)")
    p.add_argument("--cache-len", type=count(1), help="decode presets: cache length (default 1024)")
    p.add_argument("--verify", action="store_true", help="run the compiler's happens-before check on the tables and "
                                                         "print its result")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("timeline", help="draw a profiled launch's trace (profile_dir) as an SVG, time per task kind")
    p.add_argument("trace", help="a trace JSON written by GpuExecutor.trace or the profile_dir option")
    p.add_argument("--out", help="SVG path (default: the trace's, .svg)")
    p.add_argument("--start-us", type=float, help="draw from this time on (µs on the trace's clock; the printed "
                                                  "breakdown stays the whole launch's)")
    p.add_argument("--end-us", type=float, help="draw up to this time")
    p.add_argument("--title", help="title line (default: the trace's file name)")
    p.set_defaults(func=cmd_timeline)
    from mpk.engine.commands import add_commands

    add_commands(sub, count, page_size)
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except MpkError as e:
        print(f"mpk {ns.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mpk {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
