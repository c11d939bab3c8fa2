"""``mpk inspect``: report, DOT, JSON and tables on disk, consistent with each other."""

from __future__ import annotations

import json

import pytest

from mpk.cli import main
from mpk.ops.linalg import op_form
from mpk.compiler.tables import Tables, validate


def test_inspect_preset_writes_report_dot_json_tables(tmp_path, capsys):
    assert main(["inspect", "qwen3-toy", "--out", str(tmp_path), "--workers", "8", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("tasks:", "dummy", "before fusion", "after fusion", "after normalization", "JIT", "AOT",
                   "tasks per op:"):
        assert needle in out
    tables = Tables.from_bytes((tmp_path / "qwen3-toy.tables").read_bytes())
    validate(tables)
    doc = json.loads((tmp_path / "qwen3-toy.json").read_text())
    assert len(doc["tasks"]) == len(tables.tasks) and len(doc["events"]) == len(tables.events)
    assert doc["stats"]["num_tasks"] == len(tables.tasks)
    dot = (tmp_path / "qwen3-toy.dot").read_text()
    assert dot.startswith("digraph mpk") and dot.count("shape=box") == len(tables.tasks)


def test_inspect_factory_file(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text("import torch\n"
                   "def make():\n"
                   "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))\n"
                   "    return m, (torch.randn(2, 16),)\n")
    assert main(["inspect", f"{src}:make", "--out", str(tmp_path / "o"), "--workers", "4",
                 "--partition", '{"matmul": {"-1": 2}}']) == 0
    out = capsys.readouterr().out
    assert "grid (1, 2)" in out


def test_inspect_paged_decode_preset(tmp_path, capsys):
    """The LLM decode step of a public shape on meta tensors: per layer one fused qkv
    projection, rope + split-KV attention in one op (rope_attn_partial) + merge (1024 positions:
    4 KV chunks per sequence), residual adds folded into the projections (no separate add op),
    the norms and SiLU·mul fused as the backend fuses them, all AOT."""
    assert main(["inspect", "qwen3-1.7b-paged", "--out", str(tmp_path), "--layers", "2", "--batch", "2",
                 "--cache-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "0 JIT" in out
    tables = Tables.from_bytes((tmp_path / "qwen3-1.7b-paged.tables").read_bytes())
    validate(tables)
    kinds = [op_form(op["kind"], op["attrs"]).removesuffix("_silu_mul") for op in tables.meta["ops"]]
    assert kinds.count("rope_attn_partial") == kinds.count("attn_merge") == 2
    assert "rope_append" not in kinds and "attn_partial" not in kinds
    # batch 2 × hidden 2048: 8 KiB of activations, so every norm after a residual projection
    # (each o and down projection's) is split between the projections around it
    # (fuse_norm_stats "auto"), the first one, after the embedding, fused into the qkv
    # projection; gate·up carries SiLU·mul
    assert kinds.count("matmul_norm_stats") == kinds.count("norm_stats_matmul") == 2 * 2
    assert kinds.count("rms_norm_matmul") == 1 and "matmul" not in kinds and "pointwise" not in kinds
    assert "rms_norm" not in kinds and "silu_mul" not in kinds


@pytest.mark.parametrize("flag,value,message", [
    ("--layers", "0", "argument --layers: '0': expected an integer >= 1"),
    ("--batch", "-2", "argument --batch: '-2': expected an integer >= 1"),
    ("--workers", "x", "argument --workers: 'x': expected an integer >= 1"),
    ("--partition", "{bad", "argument --partition: '{bad' is not JSON"),
    ("--partition", "[1]", "argument --partition: '[1]': expected a JSON object"),
])
def test_inspect_refuses_bad_values_by_name(flag, value, message, capsys):
    """A bad flag value is refused before any compile, naming the flag, the value and what it must be
    (``--layers 0`` once compiled every layer, bad JSON ended in a traceback)."""
    with pytest.raises(SystemExit) as info:
        main(["inspect", "qwen3-toy", flag, value])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_inspect_names_a_bad_factory_result_and_a_file_for_out(tmp_path, capsys):
    src = tmp_path / "f.py"
    src.write_text("def three():\n    return 3\n")
    assert main(["inspect", f"{src}:three", "--out", str(tmp_path / "o")]) == 2
    assert f"{src}:three returned int; expected (module, example_args)" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["inspect", "qwen3-toy", "--out", str(tmp_path / "afile")]) == 2
    assert f"--out {tmp_path / 'afile'} is a file; expected a directory" in capsys.readouterr().err


def test_inspect_refuses_size_flags_its_target_would_ignore(tmp_path, capsys):
    """--seq sizes the prefill presets only, --cache-len the decode ones, and a factory builds
    its own inputs: a flag the target would ignore is named (it had been dropped silently)."""
    src = tmp_path / "m.py"
    src.write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    cases = [([f"{src}:make", "--layers", "3", "--batch", "9"],
              f"--layers, --batch do not apply to {src}:make: a FILE.py:FACTORY target builds its own inputs"),
             (["qwen3-1.7b-paged", "--seq", "5"], "--seq does not apply to qwen3-1.7b-paged: it takes --layers, --batch, --cache-len"),
             (["qwen3-toy", "--cache-len", "64"], "--cache-len does not apply to qwen3-toy: it takes --layers, --batch, --seq")]
    for argv, message in cases:
        assert main(["inspect", *argv, "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="'qwen3-1.7b-pagd' is neither a preset"):  # a typo is named as one
        main(["inspect", "qwen3-1.7b-pagd", "--layers", "2", "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("doc,message", [
    ([], "expected a Chrome trace, a JSON object whose traceEvents is a list of objects"),
    ({"traceEvents": [1, 2]}, "expected a Chrome trace"),
    ({"traceEvents": [{"ph": "X", "ts": 0, "tid": 0, "args": {"op": "x"}}]}, "lacks a number among ts, dur and tid"),
    ({"traceEvents": [{"ph": "X", "ts": 1, "dur": -5, "tid": 0}]}, "has dur -5; expected a duration ≥ 0 µs"),
    ({"traceEvents": [{"ph": "X", "ts": 1, "dur": 0, "tid": 0}]}, "its task spans cover no time (all start and end at 1 µs)"),
])
def test_timeline_names_a_malformed_trace(tmp_path, capsys, doc, message):
    """mpk timeline on JSON that is not one of its traces: a message naming the file, exit 2."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["timeline", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_generate_and_bench_on_a_tiny_checkpoint(tmp_path, capsys):
    """`mpk generate --input` reads prompts and conversations from JSONL and writes one result
    line per request in input order (a bad one with its error, exit status 1); --prompt writes
    to stdout; `mpk bench throughput` prints one JSON line of rates."""
    import random

    import torch

    from mpk.testing.decode import small_config
    from mpk.testing.engine import VOCAB, tiny_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: threads on a shared machine only wait on each other
    try:
        model = tiny_checkpoint(tmp_path / "m", small_config("llama", vocab=VOCAB), random.randrange(1 << 30))
        lines = [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": [5, 6, 7]},
                 {"prompt": ""}]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        flags = ["--model", str(model), "--max-model-len", "64", "--max-tokens", "5", "--temperature", "0"]
        assert main(["generate", *flags, "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "out.jsonl")]) == 1
        out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [o["prompt"] for o in out] == ["hello", "<|user|>hi\n<|assistant|>", None, ""]
        assert [o["finish_reason"] for o in out] == ["length"] * 3 + ["error"]
        assert all(len(o["token_ids"]) == 5 for o in out[:3]) and "empty prompt" in out[3]["error"]
        capsys.readouterr()
        assert main(["generate", *flags, "--prompt", "hello", "--prompt", "again"]) == 0
        printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [p["prompt"] for p in printed] == ["hello", "again"] and printed[0]["token_ids"] == out[0]["token_ids"]
        assert main(["generate", *flags]) == 2  # neither --prompt nor --input: named
        assert "expected --prompt (repeatable) or --input FILE.jsonl" in capsys.readouterr().err
        assert main(["bench", "throughput", "--model", str(model), "--input-len", "9", "--output-len", "4",
                     "--num-requests", "6"]) == 0
        doc = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert doc["bench"] == "throughput" and doc["num_requests"] == 6 and doc["output_tokens_per_s"] > 0
    finally:
        torch.set_num_threads(threads)
