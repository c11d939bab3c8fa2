"""Every error a user can cause is an mpk.errors type naming the bad value and what was expected:
options, partition overrides, a linearization handed to the modes step, and model configs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpk.compiler.depend import depend
from mpk.compiler.fuse import fuse
from mpk.compiler.linearize import linearize
from mpk.compiler.modes import assign_modes
from mpk.compiler.normalize import normalize
from mpk.compiler.partition import decompose
from mpk.compiler.prune import prune
from mpk.errors import CompileError, ConfigError, MpkError, OptionError
from mpk.llm import LLMConfig, load_pretrained
from mpk.llm.config import MAX_SIZES, SHAPES
from mpk.options import MAX_CPU_CTAS, CompileOptions, device_sms
from mpk.testing.graphs import trace_graph


def _chain(x, w):
    return torch.softmax(torch.relu(x @ w) + x, dim=-1)


def _linearized():
    graph = trace_graph(_chain, [torch.randn(6, 8), torch.randn(8, 8)])
    tg = decompose(graph, 4)
    for step in (depend, prune, fuse, normalize, linearize):
        step(tg)
    return tg


# ---------------------------------------------------------------- the modes step

def test_modes_takes_the_linearizer_order():
    tg = assign_modes(_linearized())
    assert len(tg.jit) == tg.num_tasks


@pytest.mark.parametrize("corrupt,message", [
    (lambda tg: setattr(tg, "task_order", []), r"task_order has 0 entries \(0 distinct\) for \d+ ids, lacking \[0"),
    (lambda tg: setattr(tg, "event_order", []), r"event_order has 0 entries"),
    (lambda tg: tg.task_order.append(10 ** 6), r"task_order holds \[1000000\], not ids in \[0, \d+\)"),
    (lambda tg: tg.task_order.__setitem__(0, tg.task_order[1]), r"task_order has \d+ entries \(\d+ distinct\)"),
    (lambda tg: tg.event_order.__setitem__(0, "start"), r"event_order holds \['start'\]"),
    (lambda tg: tg.event_order.reverse(), r"event_order puts event \d+ before event \d+, which launches its "
                                          r"triggering task \d+; expected a topological order"),
])
def test_a_bad_linearization_is_a_compile_error_naming_it(corrupt, message):
    """A task order that misses or repeats a task, an unknown id, or an event order that is not
    topological (each once a raw KeyError in the modes step) is named."""
    tg = _linearized()
    corrupt(tg)
    with pytest.raises(CompileError, match=message):
        assign_modes(tg)


# ---------------------------------------------------------------- options

@pytest.mark.parametrize("options", [[1, 2], "cpu", 3, ("executor", "cpu"), {1, 2}])
def test_options_that_are_not_a_mapping(options):
    with pytest.raises(OptionError, match=rf"options={__import__('re').escape(repr(options))}; expected a dict"):
        CompileOptions.parse(options)


def test_unknown_keys_of_mixed_types_are_named():
    with pytest.raises(OptionError, match=r"unknown mpk option\(s\) \['x', 1\]"):
        CompileOptions.parse({1: 2, "x": 3, "executor": "cpu"})


@pytest.mark.parametrize("key", ["num_workers", "scheduler_ctas"])
@pytest.mark.parametrize("value", [2 ** 40, 2 ** 31, MAX_CPU_CTAS + 1])
def test_cta_counts_are_bounded_before_anything_is_allocated(key, value):
    with pytest.raises(OptionError, match=rf"{key}={value}; expected at most mpk.options.MAX_CPU_CTAS \(1024\)"):
        CompileOptions.parse({"executor": "cpu", key: value})
    assert CompileOptions.parse({"executor": "cpu", key: MAX_CPU_CTAS}).__getattribute__(key) == MAX_CPU_CTAS


def test_gpu_counts_are_bounded_by_the_device(monkeypatch):
    monkeypatch.setattr("mpk.options.device_sms", lambda: 132)
    for opts, message in (({"num_workers": 133}, r"num_workers=133; expected at most the device's 132 SMs"),
                          ({"scheduler_ctas": 200}, r"scheduler_ctas=200; expected at most the device's 132 SMs"),
                          ({"num_workers": 130, "scheduler_ctas": 4}, r"num_workers=130 \+ scheduler_ctas=4 is more")):
        with pytest.raises(OptionError, match=message):
            CompileOptions.parse({"executor": "gpu", **opts})
    assert CompileOptions.parse({"executor": "gpu", "num_workers": 128, "scheduler_ctas": 4}).num_workers == 128
    # the cpu executor simulates its workers: the device does not bound them
    assert CompileOptions.parse({"executor": "cpu", "num_workers": 545}).num_workers == 545


def test_num_workers_2_40_through_torch_compile_is_an_option_error():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="mpk", options={"executor": "cpu", "num_workers": 2 ** 40})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 4))
    err = info.value
    while not isinstance(err, OptionError) and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    assert isinstance(err, OptionError) and "num_workers=1099511627776" in str(err)


@pytest.mark.parametrize("value", [math.inf, math.nan, -1, 0, "30", True, None, 1j])
def test_timeout_is_finite_and_positive(value):
    with pytest.raises(OptionError, match=r"timeout_s=.*expected a finite number of seconds > 0"):
        CompileOptions.parse({"executor": "cpu", "timeout_s": value})


@pytest.mark.parametrize("value", [1.5, "0", True, None, np.int64(3)])
def test_seed_is_an_int(value):
    with pytest.raises(OptionError, match=r"seed=.*expected an int"):
        CompileOptions.parse({"executor": "cpu", "seed": value})


@pytest.mark.parametrize("spec", [[0], [-1, 2], [True], [1.5], "x", 4, {0: 0}, {"a": 2}, {0: None}, {True: 2},
                                  [[2]], None])
def test_partition_tile_counts_are_positive_ints(spec):
    with pytest.raises(OptionError, match=r"partition\['matmul'\]=.*expected a list of tile counts"):
        CompileOptions.parse({"executor": "cpu", "partition": {"matmul": spec}})


def test_partition_keys_are_names_and_counts_are_bounded_by_the_dim():
    with pytest.raises(OptionError, match=r"partition key 3; expected an op name or op kind"):
        CompileOptions.parse({"executor": "cpu", "partition": {3: [1]}})
    graph = trace_graph(_chain, [torch.randn(6, 8), torch.randn(8, 8)])
    with pytest.raises(CompileError, match=r"1099511627776 tiles for dim 0 of size 6; expected an int in \[1, 6\]"):
        decompose(graph, 4, {"softmax": [2 ** 40, 1]})
    with pytest.raises(CompileError, match=r"True tiles for dim 0"):
        decompose(graph, 4, {"softmax": [True, 1]})
    with pytest.raises(CompileError, match=r"dims 0 and -2 are both dim 0"):
        decompose(graph, 4, {"softmax": {0: 2, -2: 3}})


def test_a_path_with_a_nul_is_an_option_error():
    with pytest.raises(OptionError, match=r"debug_dir='a\\x00b' is not a usable path"):
        CompileOptions.parse({"executor": "cpu", "debug_dir": "a\0b"})


_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
                 st.binary(max_size=4), st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.one_of(st.integers(-3, 3), st.text(max_size=3)), st.integers(-3, 3), max_size=2),
                 st.sampled_from([np.array([1, 2]), np.int64(4), np.float32(1.0), object(), 1j, math.inf, "auto",
                                  "cpu", "gpu", "eager", 2 ** 40, -(2 ** 63), [], {}, ()]))
_KEYS = st.sampled_from(sorted(CompileOptions.__dataclass_fields__) + ["unknown", "Executor", ""])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _ANY, max_size=4), st.booleans())
def test_parse_fuzz_raises_only_option_errors(options, cpu):
    """Any wrong type or value of any option is an OptionError naming the option; whatever
    parses is a CompileOptions within the bounds."""
    if cpu:
        options.setdefault("executor", "cpu")
    try:
        opts = CompileOptions.parse(options)
    except OptionError as e:
        msg = str(e)
        assert any((k and k in msg) or repr(k) in msg for k in options) or "num_workers" in msg, msg
        return
    limit = (device_sms() if opts.executor == "gpu" else None) or MAX_CPU_CTAS
    assert opts.num_workers is None or 1 <= opts.num_workers <= limit
    assert opts.scheduler_ctas is None or 0 <= opts.scheduler_ctas <= limit
    assert 0 < opts.timeout_s < math.inf and type(opts.seed) is int


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.lists(st.integers()), st.text(max_size=5), st.integers(), st.floats(), st.binary(max_size=4),
                 st.tuples(st.text(max_size=3), st.integers())))
def test_parse_fuzz_non_mappings(options):
    with pytest.raises(OptionError, match=r"options=.*expected a dict"):
        CompileOptions.parse(options)


# ---------------------------------------------------------------- configs

GOOD = SHAPES["qwen3-0.6b"].to_hf()


@pytest.mark.parametrize("content,message", [
    (b"\x93NUMPY\x01\x00binary weights\xff\xfe", r"config.json is not UTF-8 text \(byte 0: b'\\x93'\)"),
    (b'{"model_type": "llama",', r"config.json is not valid JSON"),
    (b"[1, 2, 3]", r"config.json holds a list; expected a JSON object"),
    (b'"llama"', r"config.json holds a str; expected a JSON object"),
    (b"", r"config.json is not valid JSON"),
])
def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        LLMConfig.from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    with pytest.raises(ConfigError, match=message):
        load_pretrained(tmp_path)


def test_a_directory_as_config_json_is_named(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"config.json cannot be read"):
        LLMConfig.from_hf(tmp_path)


def test_a_bad_shard_index_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GOOD))
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(MpkError, match=r"model.safetensors.index.json is not a JSON object"):
        load_pretrained(tmp_path)
    index.unlink()
    index.mkdir()
    with pytest.raises(MpkError, match=r"model.safetensors.index.json cannot be read"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("path", [3, None, b"/tmp", ["a"]])
def test_load_pretrained_path_type(path):
    with pytest.raises(MpkError, match=r"path=.*expected a checkpoint directory"):
        load_pretrained(path)


_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_WRONG = [-1, 0, 1.5, "64", True, [64], {"a": 1}, -(10 ** 400)]


@pytest.mark.parametrize("key", _INT_FIELDS)
@pytest.mark.parametrize("value", _WRONG)
def test_wrong_sizes_are_config_errors_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=rf"config: {key} .*expected a positive integer"):
        LLMConfig.from_hf(GOOD | {key: value})


@pytest.mark.parametrize("key", sorted(MAX_SIZES))
def test_huge_sizes_are_refused_before_anything_is_allocated(key):
    fields = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
              "num_attention_heads * head_dim": "num_attention_heads", "num_attention_heads": "num_attention_heads",
              "head_dim": "head_dim",
              "num_hidden_layers": "num_hidden_layers", "max_position_embeddings": "max_position_embeddings"}
    cfg = GOOD | {fields[key]: 2 ** 40}
    if key == "num_attention_heads * head_dim":
        cfg["num_key_value_heads"] = 1
        cfg["num_attention_heads"] = MAX_SIZES[key] // GOOD["head_dim"] * 2
    with pytest.raises(ConfigError, match=rf"config: {__import__('re').escape(key)} \d+ is more than "
                                          rf"{MAX_SIZES[key]}; expected at most that"):
        LLMConfig.from_hf(cfg)
    for name, shape in SHAPES.items():  # every public shape fits
        assert LLMConfig.from_hf(shape.to_hf()) == shape, name


@pytest.mark.parametrize("key,value,message", [
    ("model_type", ["llama"], r"model_type \['llama'\] is not supported"),
    ("model_type", {"a": 1}, r"model_type \{'a': 1\} is not supported"),
    ("hidden_act", ["silu"], r"hidden_act \['silu'\] is not supported"),
    ("rms_norm_eps", "1e-6", r"rms_norm_eps '1e-6'; expected a positive number"),
    ("rms_norm_eps", -1e-6, r"rms_norm_eps -1e-06"),
    ("rms_norm_eps", 10 ** 400, r"rms_norm_eps 1000"),
    ("rope_theta", "1e6", r"rope_theta '1e6'; expected a positive number"),
    ("rope_theta", 10 ** 400, r"rope_theta 1000"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings 'yes'; expected true or false"),
    ("rope_scaling", [1], r"rope_scaling \[1\]; expected a JSON object"),
    ("rope_scaling", {"rope_type": ["x"]}, r"rope_scaling type \['x'\] is not supported"),
    ("rope_scaling", {"rope_type": "llama3", "factor": "8"}, r"rope_scaling: factor '8'; expected a positive number"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, r"rope_scaling lacks 'low_freq_factor'"),
    ("layer_types", "full_attention", r"layer_types 'full_attention'; expected a list of strings"),
    ("layer_types", [1, 2], r"layer_types \[1, 2\]; expected a list of strings"),
    ("max_window_layers", "28", r"max_window_layers '28'; expected an int >= 0 or null"),
    ("sliding_window", -5, r"sliding_window -5; expected an int >= 0 or null"),
    ("use_sliding_window", "no", r"use_sliding_window 'no'; expected true or false"),
    ("quantization_config", {"quant_method": ["x"]}, r"quantized checkpoints \(quant_method \['x'\]\)"),
])
def test_wrong_types_of_other_fields_are_config_errors_naming_them(key, value, message):
    with pytest.raises(ConfigError, match=message):
        LLMConfig.from_hf(GOOD | {key: value})


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=3)), max_leaves=6)
_CONFIG_KEYS = st.sampled_from(sorted(GOOD) + ["rope_scaling", "rope_parameters", "layer_types", "sliding_window",
                                               "use_sliding_window", "max_window_layers", "quantization_config",
                                               "hidden_act", "mlp_bias"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_CONFIG_KEYS, _JSON, max_size=3), st.sets(_CONFIG_KEYS, max_size=2))
def test_config_fuzz_raises_only_config_errors(changes, dropped):
    """Any config built from a good one by replacing and dropping fields either loads (within
    MAX_SIZES) or raises a ConfigError."""
    cfg = {k: v for k, v in (GOOD | changes).items() if k not in dropped}
    try:
        out = LLMConfig.from_hf(cfg)
    except ConfigError:
        return
    assert out.hidden <= MAX_SIZES["hidden_size"] and out.max_position <= MAX_SIZES["max_position_embeddings"]
