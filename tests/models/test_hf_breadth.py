"""The breadth suite: Hugging Face models called the usual way compile whole.

Tiny random-weight configs (1 layer, hidden 32, vocab 96, float32, eval mode) of transformers'
decoder LMs, encoders and T5 are called as user code calls them — ``model(input_ids,
attention_mask=...)``, decoders with transformers' default cache (``use_cache=True``: a
DynamicCache grown inside forward) — under ``torch.compile(model, backend="mpk",
fullgraph=True)`` on the CPU executor in strict mode (``fallback="error"``: every ATen op of
the graph lowers, none runs in PyTorch), and must match eager. So must Whisper's encoder
(``input_features``), ViT, CLIP's vision tower and transformers' ResNet (bottleneck blocks;
``pixel_values``), and plain torch networks: ResNet-18's layout ([2, 2, 2, 2] basic blocks)
at widths 8…64, a UNet level with group norm, a ConvNeXt block. The models, their inputs and
the outputs compared are ``mpk.testing.breadth_models``'s (tests/gpu/test_gpu_hf_breadth.py
runs the same list in bf16 on the GPU). Greedy ``generate`` with
transformers' static cache (its writes are ``index_copy_`` at the cache positions; a sliding
layer's ``roll``) compiles whole too. Weights and inputs are fresh each run (the suite's ``MPK_TEST_SEED``).

Tolerance: ``relative_error`` (max |out − ref| / max |ref|) ≤ 1e-5 against eager float32 (the
suite's contract). Both implementations round in float32; the first-order bound of
``mpk.testing.tolerance`` for one layer of these sizes — about 40 roundings of gain ≤ √2 and
≈ 350 fp32 sum terms (the projections' hidden/intermediate-long dot products, head_dim-long
scores, the softmax's and P·V's position sums, the norms' hidden sums), twice for two
implementations — is ``2 * rounding_bound(float32, 40, 350)`` ≈ 4.6e-5, so 1e-5 keeps well
inside what rounding alone allows while standing 20× or more above the errors these models show
(≤ 7e-7): a wrong mask, position or op is orders of magnitude larger. The deeper convolutional
nets (ResNet-18: nine blocks, sums of up to 576 terms) have a first-order bound above 1e-5, but
their errors add like a random walk and stay ≤ 3e-7 (as do the vision and audio encoders'), so
1e-5 holds for them too.
"""

from __future__ import annotations

import pytest
import torch

from mpk.testing.breadth_models import MODELS, build, compared, inputs
from mpk.testing.graphs import relative_error

pytest.importorskip("transformers")

# strict mode (the default fallback, spelled out); 8 simulated workers rather than the CPU
# executor's 128 keep the interpreter's task count, and the suite's time, small
OPTIONS = {"executor": "cpu", "num_workers": 8, "fallback": "error"}
TOLERANCE = 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_usual_call_compiles_whole_and_matches_eager(name):
    model = build(name)
    args, kwargs = inputs(name)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(*args, **kwargs)
        out = torch.compile(model, backend="mpk", fullgraph=True, options=OPTIONS)(*args, **kwargs)
    got, expected = compared(name, out), compared(name, ref)
    assert len(got) == len(expected)
    for o, r in zip(got, expected):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert relative_error(o, r) <= TOLERANCE


@pytest.mark.parametrize("name,new_tokens", [("llama_gqa", 4), ("mistral", 3)])
def test_static_cache_generate_compiles_whole(name, new_tokens):
    """Greedy ``generate`` with ``cache_implementation="static"`` and the model's forward
    compiled (``dynamic=False``: mpk compiles static shapes) gives eager's tokens and scores; the
    prefill and the decode step each compile whole. Mistral's window (4) is shorter than the
    prompt, so its sliding layer's decode step rolls the full cache (``roll`` and an index write).
    That layer counts its length in a Python int, which Dynamo specializes on: each of its
    decode steps compiles anew, hence the few tokens."""
    model = build(name)
    (ids,), kwargs = inputs(name)
    kwargs.update(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                  return_dict_in_generate=True, output_scores=True)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, backend="mpk", fullgraph=True, dynamic=False, options=OPTIONS)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for o, r in zip(out.scores, ref.scores, strict=True):
        assert relative_error(o, r) <= TOLERANCE
