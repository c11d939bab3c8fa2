"""load_pretrained on transformers-written checkpoints: shards, progress, and a clear error for
every checkpoint it cannot load faithfully (nothing dropped or guessed)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from mpk.errors import MpkError
from mpk.llm import LLMConfig, load_pretrained

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _checkpoint(tmp_path, family: str) -> tuple:
    """A random-weight transformers model of ``family`` saved under tmp_path/family; returns its
    directory and its tensors (name -> tensor)."""
    cfg = LLMConfig(family=family, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=97,
                    tied=family == "llama", eps=1e-6, rope_theta=1e4, max_position=128)
    torch.manual_seed(random.randrange(1 << 30))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()))
    path = tmp_path / family
    hf.save_pretrained(path, safe_serialization=True)
    return path, safetensors_torch.load_file(str(path / "model.safetensors"))


def _rewrite(path, *shards: dict) -> None:
    """Replace the checkpoint's weights by these shards (one file each)."""
    for f in path.glob("*.safetensors*"):
        f.unlink()
    for i, shard in enumerate(shards):
        safetensors_torch.save_file({k: v.contiguous() for k, v in shard.items()},
                                    str(path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_shards_load_as_one_file_with_progress(tmp_path, capsys, family):
    path, tensors = _checkpoint(tmp_path, family)
    capsys.readouterr()  # transformers' own progress output
    whole = load_pretrained(path, torch.float32, progress=False)
    assert capsys.readouterr().err == ""
    names = sorted(tensors)
    _rewrite(path, {k: tensors[k] for k in names[::2]}, {k: tensors[k] for k in names[1::2]})
    sharded = load_pretrained(path, torch.float32, progress=True)
    err = capsys.readouterr().err
    assert f"loading {family}" in err and "100%" in err
    assert dict(whole.named_parameters()).keys() == dict(sharded.named_parameters()).keys()
    for (name, a), (_, b) in zip(whole.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name
    # the fused weights hold the checkpoint's tensors, in q|k|v and gate|up order
    layer = sharded.layers[1]
    p = "model.layers.1."
    assert torch.equal(layer.qkv, torch.cat([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float())
    assert torch.equal(layer.gate_up, torch.cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]).float())
    assert sum(p.numel() for p in sharded.parameters()) == sum(t.numel() for t in tensors.values())  # all of it


def _missing(t):
    del t["model.layers.1.mlp.down_proj.weight"]
    return "lacks 1 tensors the config implies: model.layers.1.mlp.down_proj.weight"


def _bias(t):
    t["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)
    return "1 tensors a qwen3 decoder with this config does not use .*: model.layers.0.self_attn.q_proj.bias"


def _shape(t):
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :48]
    return r"shape \(64, 48\); the config implies \(64, 64\)"


def _split(t):
    """q / k / v rows redistributed so that the fused q|k|v keeps its shape: each piece is checked"""
    p = "model.layers.1.self_attn."
    qkv = torch.cat([t[p + f"{x}_proj.weight"] for x in "qkv"])  # 64 + 32 + 32 rows
    t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"] = qkv[:48], qkv[48:88], qkv[88:]
    return r"model.layers.1.self_attn.q_proj.weight has shape \(48, 64\); the config implies \(64, 64\)"


def _int8(t):
    name = "model.layers.0.mlp.down_proj.weight"
    t[name] = torch.randint(-127, 128, t[name].shape, dtype=torch.int8)  # quantized codes, no config for them
    return rf"weights stored in a non-float dtype: {name} \(I8\); expected one of BF16, F16, F32, F64"


def _bool(t):
    t["model.norm.weight"] = t["model.norm.weight"] > 0
    return r"non-float dtype: model.norm.weight \(BOOL\)"


@pytest.mark.parametrize("corrupt", [_missing, _bias, _shape, _split, _int8, _bool])
def test_unfaithful_checkpoints_are_refused_by_name(tmp_path, corrupt):
    path, tensors = _checkpoint(tmp_path, "qwen3")
    message = corrupt(tensors)
    _rewrite(path, tensors)
    with pytest.raises(MpkError, match=message):
        load_pretrained(path, torch.float32)


def test_an_index_names_the_shards(tmp_path):
    """With model.safetensors.index.json only the shards it names are read (a stray file beside
    them is not), and a shard it names that is not there is an error."""
    import json

    path, tensors = _checkpoint(tmp_path, "qwen3")
    names = sorted(tensors)
    _rewrite(path, {k: tensors[k] for k in names[::2]}, {k: tensors[k] for k in names[1::2]})
    shards = sorted(f.name for f in path.glob("*.safetensors"))
    weight_map = {k: shards[i % 2] for i, k in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    safetensors_torch.save_file({"stray.weight": torch.randn(3)}, str(path / "consolidated.safetensors"))
    model = load_pretrained(path, torch.float32)
    assert torch.equal(model.norm, tensors["model.norm.weight"].float())
    (path / shards[1]).unlink()
    with pytest.raises(MpkError, match=f"names shards that are not there: {shards[1]}"):
        load_pretrained(path, torch.float32)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(MpkError, match="model.safetensors.index.json has no weight_map of tensor names to shard files"):
        load_pretrained(path, torch.float32)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    path, tensors = _checkpoint(tmp_path, "qwen3")
    name = "model.norm.weight"
    _rewrite(path, tensors, {name: tensors[name] + 1})
    with pytest.raises(MpkError, match=f"tensor {name} is in both model-00001-of-00002.safetensors and "
                                       "model-00002-of-00002.safetensors"):
        load_pretrained(path, torch.float32)


def test_tied_head_in_the_checkpoint_must_be_the_embedding(tmp_path):
    path, tensors = _checkpoint(tmp_path, "llama")  # tie_word_embeddings: no lm_head.weight saved
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    _rewrite(path, tensors | {"lm_head.weight": embed.clone(),
                              "model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(8)})
    model = load_pretrained(path, torch.float32)  # the same matrix, and a rotary table: both fine
    assert model.lm_head is None and torch.equal(model.embed, embed.float())
    other = embed.clone()
    other[random.randrange(embed.shape[0]), random.randrange(embed.shape[1])] += 1
    _rewrite(path, tensors | {"lm_head.weight": other})
    with pytest.raises(MpkError, match="ties the LM head to the embedding .* lm_head.weight differs"):
        load_pretrained(path, torch.float32)


def test_weights_past_the_load_dtype_range_are_refused(tmp_path):
    """A weight that a float16 load turns into inf (the checkpoint holds 2^20 at a random spot)
    is named with the largest stored magnitude; the same checkpoint loads as bfloat16, whose
    range holds it. A checkpoint that stores inf or NaN itself is refused in any dtype."""
    path, tensors = _checkpoint(tmp_path, "qwen3")
    name = "model.layers.1.mlp.down_proj.weight"
    big = tensors[name].clone()
    big[random.randrange(big.shape[0]), random.randrange(big.shape[1])] = 2.0 ** 20
    _rewrite(path, tensors | {name: big})
    with pytest.raises(MpkError, match=rf"{name} holds 1 non-finite values as torch.float16 \(the largest stored "
                                       r"magnitude is 1.049e\+06\); expected finite weights"):
        load_pretrained(path, torch.float16)
    assert torch.isfinite(load_pretrained(path, torch.bfloat16).layers[1].down).all()
    broken = tensors["model.norm.weight"].clone()
    broken[random.randrange(broken.shape[0])] = float("nan")
    _rewrite(path, tensors | {"model.norm.weight": broken})
    with pytest.raises(MpkError, match=r"model.norm.weight holds 1 non-finite values as torch.float32; the "
                                       "checkpoint itself stores inf or NaN there"):
        load_pretrained(path, torch.float32)


def test_float16_weights_loaded_as_bfloat16_warn(tmp_path):
    path, tensors = _checkpoint(tmp_path, "llama")
    _rewrite(path, {k: v.half() for k, v in tensors.items()})
    with pytest.warns(UserWarning, match="stores float16 weights; loading them as bfloat16 drops 3 bits"):
        load_pretrained(path, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_pretrained(path, torch.float16)
        _rewrite(path, tensors)  # float32: bfloat16 is the usual inference copy, no warning
        load_pretrained(path, torch.bfloat16)


def test_unreadable_files_are_named(tmp_path):
    """No config.json, a shard that is not safetensors, and an index naming a file outside the
    checkpoint: each an MpkError naming the file (not a bare OSError or SafetensorError)."""
    import json

    from mpk.errors import ConfigError

    path, tensors = _checkpoint(tmp_path, "qwen3")
    (path / "model.safetensors").unlink()  # (tensors still maps it: a write in place would fault them)
    (path / "model.safetensors").write_bytes(b"\x03\x00")
    with pytest.raises(MpkError, match="model.safetensors is not a readable safetensors file"):
        load_pretrained(path, torch.float32)
    _rewrite(path, tensors)
    shard = next(path.glob("*.safetensors")).name
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": f"../other/{shard}"}}))
    with pytest.raises(MpkError, match=f"maps tensors to files outside its directory: ../other/{shard}"):
        load_pretrained(path, torch.float32)
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json cannot be read \(No such file or directory\)"):
        LLMConfig.from_hf(path)
