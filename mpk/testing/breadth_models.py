"""The breadth suite's models: tiny random-weight builders of transformers' decoder
LMs, encoders, T5, Whisper's encoder, ViT, CLIP's vision tower and ResNet, and plain torch
convolutional networks (a ResNet-18-shaped net, a UNet level with group norm, a ConvNeXt
block), with the inputs each is called with the usual way and the outputs to compare.
tests/models/test_hf_breadth.py runs them on the CPU executor in float32,
tests/gpu/test_gpu_hf_breadth.py on the GPU executor in bfloat16; both read this one list.

transformers is imported when a builder runs, so this module imports without it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpk.testing.conv_models import ConvNeXtBlock, ResNet18, UNetBlock, randomize_batch_norms

VOCAB, HIDDEN, INTER, HEADS, POSITIONS = 96, 32, 64, 4, 32
BATCH, SEQ = 2, 7
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# the usual decoder fields; kv heads and head_dim spelled out where a config's defaults are not tiny
LM = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
      "num_attention_heads": HEADS, "max_position_embeddings": POSITIONS, **TOKENS}
GQA = {**LM, "num_key_value_heads": 2}
# RoBERTa's positions start after the padding index: two more than the sequence
ENCODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
           "num_attention_heads": HEADS, "max_position_embeddings": POSITIONS + 2, "pad_token_id": 0}
# ViT / CLIP: 16×16 images in 4×4 patches (16 patches and the class token)
VISION = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
          "image_size": 16, "patch_size": 4}
MEL_BINS, MEL_FRAMES = 8, 16  # Whisper's encoder takes 2·max_source_positions frames (its convs halve them)


def _t(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def _whisper_encoder() -> torch.nn.Module:
    cfg = _t("WhisperConfig")(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=INTER,
                              decoder_ffn_dim=INTER, num_mel_bins=MEL_BINS, max_source_positions=MEL_FRAMES // 2,
                              max_target_positions=POSITIONS, decoder_start_token_id=1, **TOKENS)
    return _t("WhisperModel")(cfg).get_encoder()


def _seeded_batch_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Random batch-norm statistics and affine parameters (fresh ones are the identity), drawn
    from the global generator the tests seed."""
    return randomize_batch_norms(model, torch.Generator().manual_seed(int(torch.randint(1 << 31, ()))))


@dataclass(frozen=True)
class Breadth:
    """One model of the suite. ``kind``: "decoder" (a causal LM with a cache), "encoder" (token
    ids), "seq2seq" (T5), "audio" (Whisper's ``input_features``), "vision" (transformers'
    ``pixel_values``) or "torch" (a plain module of one image tensor); ``shape``: the input's,
    for "audio", "vision" and "torch"; ``blocks``: residual blocks (transformer layers, conv
    blocks) on the longest way from input to output, what a precision bound scales with."""

    kind: str
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...] | None = None
    blocks: int = 1


MODELS: dict[str, Breadth] = {
    "gpt2": Breadth("decoder", lambda: _t("GPT2LMHeadModel")(_t("GPT2Config")(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS, n_positions=POSITIONS, **TOKENS))),
    "gpt_neox": Breadth("decoder", lambda: _t("GPTNeoXForCausalLM")(_t("GPTNeoXConfig")(**LM))),
    "llama": Breadth("decoder", lambda: _t("LlamaForCausalLM")(_t("LlamaConfig")(**LM))),
    "llama_gqa": Breadth("decoder", lambda: _t("LlamaForCausalLM")(_t("LlamaConfig")(**GQA))),
    # a window shorter than the sequence, so the sliding mask cuts in
    "mistral": Breadth("decoder", lambda: _t("MistralForCausalLM")(_t("MistralConfig")(**GQA, sliding_window=4))),
    "qwen2": Breadth("decoder", lambda: _t("Qwen2ForCausalLM")(_t("Qwen2Config")(**GQA))),
    "qwen3": Breadth("decoder", lambda: _t("Qwen3ForCausalLM")(_t("Qwen3Config")(**GQA, head_dim=8))),
    "phi3": Breadth("decoder", lambda: _t("Phi3ForCausalLM")(_t("Phi3Config")(**GQA))),
    "gemma": Breadth("decoder", lambda: _t("GemmaForCausalLM")(_t("GemmaConfig")(**GQA, head_dim=8))),
    # one layer: a sliding-window one (Gemma2 alternates), with attention and final logit softcapping
    "gemma2": Breadth("decoder", lambda: _t("Gemma2ForCausalLM")(_t("Gemma2Config")(
        **GQA, head_dim=8, sliding_window=4))),
    "opt": Breadth("decoder", lambda: _t("OPTForCausalLM")(_t("OPTConfig")(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=POSITIONS, **TOKENS))),
    "bloom": Breadth("decoder", lambda: _t("BloomForCausalLM")(_t("BloomConfig")(
        vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=1, n_head=HEADS, **TOKENS))),
    "falcon": Breadth("decoder", lambda: _t("FalconForCausalLM")(_t("FalconConfig")(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, **TOKENS))),
    # partial rotary (the default 0.25 of head_dim) and its own LayerNorm
    "stablelm": Breadth("decoder", lambda: _t("StableLmForCausalLM")(_t("StableLmConfig")(
        **LM, num_key_value_heads=HEADS))),
    "bert": Breadth("encoder", lambda: _t("BertModel")(_t("BertConfig")(**ENCODER))),
    "roberta": Breadth("encoder", lambda: _t("RobertaModel")(_t("RobertaConfig")(**ENCODER))),
    # an encoder layer and a decoder layer (self- and cross-attention)
    "t5": Breadth("seq2seq", lambda: _t("T5ForConditionalGeneration")(_t("T5Config")(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTER, num_layers=1, num_heads=HEADS,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)), blocks=2),
    # two strided conv1d + GELU, sinusoidal positions, a pre-norm layer
    "whisper_encoder": Breadth("audio", _whisper_encoder, (BATCH, MEL_BINS, MEL_FRAMES)),
    "vit": Breadth("vision", lambda: _t("ViTModel")(_t("ViTConfig")(**VISION)), (BATCH, 3, 16, 16)),
    # quick_gelu, pre- and post-layernorm, the class token's pooled output
    "clip_vision": Breadth("vision", lambda: _t("CLIPVisionModel")(_t("CLIPVisionConfig")(**VISION)),
                           (BATCH, 3, 16, 16)),
    # transformers' ResNet with bottleneck blocks (ResNet-50's kind), one per stage
    "resnet_hf": Breadth("vision", lambda: _t("ResNetModel")(_t("ResNetConfig")(
        embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], layer_type="bottleneck")),
        (BATCH, 3, 32, 32), blocks=5),
    # basic blocks [2, 2, 2, 2] as ResNet-18, widths 8…64
    "resnet18": Breadth("torch", lambda: _seeded_batch_norms(ResNet18(8)), (BATCH, 3, 32, 32), blocks=9),
    # conv, group norm, pooling down, transposed conv and upsampling up, skip concatenation
    "unet_block": Breadth("torch", lambda: UNetBlock(8, norm="group"), (BATCH, 3, 16, 16), blocks=4),
    "convnext_block": Breadth("torch", lambda: ConvNeXtBlock(16), (BATCH, 16, 9, 9)),
}


def build(name: str) -> torch.nn.Module:
    """The tiny model with fresh random weights (the caller's seeded global generator), eval mode."""
    return MODELS[name].build().eval()


def inputs(name: str) -> tuple[tuple, dict]:
    """The call's positional and keyword arguments, float32 on the CPU. Token ids come as a
    padded batch as a tokenizer makes it: left padding for decoders (the row's first positions
    masked), right padding for encoders."""
    spec = MODELS[name]
    if spec.shape is not None:
        return (torch.randn(spec.shape),), {}
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    mask = torch.ones_like(ids)
    pad = random.randint(1, SEQ // 2)
    if spec.kind == "decoder":
        mask[0, :pad] = 0
    else:
        mask[0, SEQ - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = {"attention_mask": mask}
    if spec.kind == "seq2seq":
        kwargs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, SEQ - 2))
    return (ids,), kwargs


def compared(name: str, out) -> list[torch.Tensor]:
    """The outputs to compare: logits or the last hidden state (and the pooled output where the
    model has one); a decoder's cache keys and values (what its next step reads); T5's encoder
    output; a plain module's output."""
    kind = MODELS[name].kind
    if kind == "torch":
        return [out]
    if kind in ("encoder", "vision"):
        return [out.last_hidden_state, out.pooler_output]
    if kind == "audio":
        return [out.last_hidden_state]
    if kind == "seq2seq":
        return [out.logits, out.encoder_last_hidden_state]
    return [out.logits] + [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
