"""Where a decode step's warps wait, instruction by instruction: Nsight Compute's warp-state
samples of one megakernel launch, attributed to the task functions and source lines.

On the device (ncu on PATH or at /usr/local/cuda/bin/ncu; the step's cubin prebuilt or built):

    python benchmarks/ncu_stalls.py run --models llama3.2-1b --batches 1 --out DIR

profiles one step per (model, batch) under ``ncu --clock-control none`` (the GPU's own clocks,
as the benchmarks run), keeps the report (``DIR/<model>-b<batch>.ncu-rep``), its SASS page as
CSV (``…-sass.csv``: per instruction its executions and stall samples by reason) and the cubin
the step ran (``…-cubin``). ``report`` reads those three anywhere (no GPU, no ncu): it splits the
samples by function (nvdisasm on the cubin names each instruction's function and, from the
cubin's line table, its source line) and prints the functions, reasons and lines that hold the
most.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARMUP = 3  # steps before the profiled one: the first builds and loads the kernel


def ncu_path() -> str:
    """ncu on PATH, else CUDA's default install; a clear error where neither exists."""
    found = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if Path(p).exists()), None)
    if found is None:
        raise SystemExit("ncu_stalls: Nsight Compute's `ncu` is neither on PATH nor at /usr/local/cuda/bin/ncu")
    return found


def child(model_name: str, batch: int, position: int, page_size: int, cubin_out: Path) -> None:
    """The profiled process: WARMUP + 1 decode steps of a random-weight model (as decode_latency
    times them); the cubin the step runs is copied to ``cubin_out``."""
    import torch

    from decode_latency import compile_step, max_len, random_model

    from mpk.backend import COMPILED
    from mpk.executors import build
    from mpk.executors.codegen import generate
    from mpk.llm import SHAPES

    model = random_model(SHAPES[model_name], max_len(position))
    step, kv = compile_step(model, batch, position, page_size)
    with torch.no_grad():
        kv.cache.normal_()
    tokens = torch.randint(0, model.cfg.vocab, (batch,), device="cuda")
    with torch.no_grad():
        for _ in range(WARMUP + 1):
            step(tokens, *kv.args())
    torch.cuda.synchronize()
    shutil.copyfile(build.build_cubin(generate(COMPILED[-1].tables)), cubin_out)


def run(args: argparse.Namespace) -> int:
    ncu = ncu_path()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        for batch in args.batches:
            tag = f"{name}-b{batch}"
            rep, csv, cubin = args.out / f"{tag}.ncu-rep", args.out / f"{tag}-sass.csv", args.out / f"{tag}-cubin"
            cmd = [ncu, "--clock-control", "none", "-f", "-o", str(rep.with_suffix("")),
                   "-k", "regex:mpk_persistent_kernel", "--launch-skip", str(WARMUP), "--launch-count", "1",
                   "--section", "SourceCounters", "--section", "WarpStateStats", "--section", "SchedulerStats",
                   "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis",
                   sys.executable, __file__, "_child", name, str(batch), str(args.position), str(args.page_size),
                   str(cubin)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
            with csv.open("w") as fh:
                subprocess.run([ncu, "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                               check=True, stdout=fh)
            with (args.out / f"{tag}-details.txt").open("w") as fh:
                subprocess.run([ncu, "-i", str(rep), "--page", "details"], check=True, stdout=fh)
            print(f"{tag}: {rep}, {csv}, {cubin}", flush=True)
    return 0


def nvdisasm_path() -> str | None:
    """nvdisasm on PATH, beside nvcc, or from the nvidia-cuda-nvdisasm wheel; None if none."""
    found = shutil.which("nvdisasm")
    nvcc = shutil.which("nvcc")
    if found is None and nvcc and (Path(nvcc).parent / "nvdisasm").exists():
        found = str(Path(nvcc).parent / "nvdisasm")
    if found is None:
        try:
            import nvidia.cu13  # the CUDA 13 wheels' namespace (pip install nvidia-cuda-nvdisasm)

            wheel = Path(next(iter(nvidia.cu13.__path__))) / "bin" / "nvdisasm"
            found = str(wheel) if wheel.exists() else None
        except ImportError:
            pass
    return found


@dataclass
class Code:
    """A cubin's functions (offset ranges, demangled names) and each instruction's source line."""
    funcs: list[tuple[int, int, str]]  # (start, end, name), sorted
    lines: dict[int, str] = field(default_factory=dict)  # instruction offset → "file:line"

    def function(self, offset: int) -> str:
        """The innermost function holding ``offset`` (the kernel's symbol spans its callees too)."""
        inner = [(hi - lo, name) for lo, hi, name in self.funcs if lo <= offset < hi]
        return min(inner)[1] if inner else "?"


def short_names(mangled: list[str]) -> list[str]:
    """Functions' demangled names (one c++filt call) without namespace and parameter list,
    template arguments kept. A callee's symbol is ``$<kernel>$<its mangled name>``."""
    plain = [m.rsplit("$", 1)[-1] for m in mangled]
    out = subprocess.run(["c++filt", *plain], capture_output=True, text=True).stdout.splitlines() if plain else []
    names = []
    for raw, name in zip(plain, out if len(out) == len(plain) else plain):
        depth, cut = 0, len(name)
        for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
            depth += ch == "<"
            depth -= ch == ">"
            if ch == "(" and depth == 0:
                cut = i
                break
        names.append(re.sub(r"\bmpk::", "", name[:cut]) or raw)
    return names


def parse_line_table(disassembly: str) -> dict[int, str]:
    """Instruction offset → "file:line" from ``nvdisasm -g`` output (a ``//## File "…", line N``
    comment before the instructions it covers)."""
    lines, where = {}, "?"
    for text in disassembly.splitlines():
        m = re.match(r'\s*//## File "(.*)", line (\d+)', text)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", text)
        if m:
            lines[int(m.group(1), 16)] = where
    return lines


def read_code(cubin: Path) -> Code:
    """The function table (readelf) and, where nvdisasm is found, the line table of a cubin
    whose code sits in one text section (the persistent kernel's, noinline callees included)."""
    syms = subprocess.run(["readelf", "-sW", str(cubin)], capture_output=True, text=True, check=True).stdout
    rows = [f for f in map(str.split, syms.splitlines()) if len(f) >= 8 and f[3] == "FUNC" and int(f[2], 0) > 0]
    names = short_names([f[-1] for f in rows])
    code = Code(sorted((int(f[1], 16), int(f[1], 16) + int(f[2], 0), name) for f, name in zip(rows, names)))
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        print("ncu_stalls: no nvdisasm (pip install nvidia-cuda-nvdisasm): samples by function only", file=sys.stderr)
    else:
        dis = subprocess.run([nvdisasm, "-g", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        code.lines = parse_line_table(dis)
    return code


STALLS = ("barrier", "branch_resolving", "dispatch", "drain", "imc", "lg", "long_sb", "math", "membar", "mio",
          "misc", "no_inst", "not_selected", "selected", "short_sb", "sleep", "tex", "wait")


@dataclass
class Instr:
    offset: int
    sass: str
    samples: int
    executed: int
    stalls: Counter


def read_sass(path: Path) -> list[Instr]:
    """ncu's SASS page (``--page source --csv --print-source sass``): offsets from the kernel's
    first instruction."""
    with path.open() as fh:
        rows = list(csv.reader(fh))
    head = rows.index(next(r for r in rows if r and r[0] == "Address"))
    cols = {name: i for i, name in enumerate(rows[head])}
    def num(r: list[str], name: str) -> int:  # "" or "-": no data
        v = r[cols[name]]
        return int(float(v)) if v not in ("", "-") else 0

    out, base = [], None
    for r in rows[head + 1:]:
        if not r or not r[0].startswith("0x"):
            continue
        addr = int(r[0], 16)
        base = addr if base is None else base
        out.append(Instr(addr - base, r[cols["Source"]].strip(), num(r, "Warp Stall Sampling (All Samples)"),
                         num(r, "Instructions Executed"),
                         Counter({s: num(r, f"stall_{s}") for s in STALLS if f"stall_{s}" in cols})))
    return out


def reasons(c: Counter, total: int, n: int = 3) -> str:
    return ", ".join(f"{k} {v / total:.0%}" for k, v in c.most_common(n) if v) if total else ""


def report(sass: Path, cubin: Path, top: int = 25) -> str:
    """The samples of one profiled launch by function, by source line and by instruction."""
    code, ins = read_code(cubin), read_sass(sass)
    total = sum(i.samples for i in ins) or 1
    by_func: dict[str, list[Instr]] = defaultdict(list)
    by_line: dict[tuple[str, str], list[Instr]] = defaultdict(list)
    for i in ins:
        f = code.function(i.offset)
        by_func[f].append(i)
        by_line[(f, code.lines.get(i.offset, "?"))].append(i)
    out = [f"{sass.name}: {total} warp samples, {len(ins)} instructions"]

    def table(title: str, groups: dict, label) -> None:
        out.append(f"\n{title}\n{'samples':>8} {'share':>6}  {'where':60s} top reasons")
        ranked = sorted(groups.items(), key=lambda kv: -sum(i.samples for i in kv[1]))[:top]
        for key, group in ranked:
            n = sum(i.samples for i in group)
            stalls = sum((i.stalls for i in group), Counter())
            out.append(f"{n:8d} {n / total:6.1%}  {label(key, group):60.60s} {reasons(stalls, n)}")

    table("by function", by_func, lambda k, g: k)
    table("by source line (function, line)", by_line, lambda k, g: f"{k[1]} {k[0]}")
    out.append(f"\nby instruction\n{'samples':>8} {'share':>6} {'executed':>9}  {'offset':>6}  {'where':28s} sass")
    for i in sorted(ins, key=lambda i: -i.samples)[:top]:
        out.append(f"{i.samples:8d} {i.samples / total:6.1%} {i.executed:9d}  {i.offset:6x}  "
                   f"{code.lines.get(i.offset, '?'):28.28s} {i.sass}  [{reasons(i.stalls, i.samples, 2)}]")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), Path(argv[5]))
        return 0
    from decode_latency import add_step_args

    from mpk.cli import count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile decode steps under ncu (on the GPU machine)")
    add_step_args(r)
    r.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("report", help="samples by function, source line and instruction (no GPU needed)")
    p.add_argument("prefix", type=Path, help="DIR/<model>-b<batch>, as `run` wrote it")
    p.add_argument("--top", type=count(1), default=25, help="rows per table (default 25)")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        sass, cubin = Path(f"{args.prefix}-sass.csv"), Path(f"{args.prefix}-cubin")
        missing = [str(f) for f in (sass, cubin) if not f.is_file()]
        if missing:
            found = sorted(f.name.removesuffix("-sass.csv") for f in args.prefix.parent.glob("*-sass.csv"))
            ap.error(f"report {args.prefix}: no {' or '.join(missing)} (written by `ncu_stalls.py run --out "
                     f"{args.prefix.parent}`); runs there: {', '.join(found) or 'none'}")
        print(report(sass, cubin, args.top))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
