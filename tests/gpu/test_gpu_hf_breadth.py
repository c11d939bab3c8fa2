"""The breadth suite on the GPU (marker ``gpu``; skipped without CUDA): every model of
``mpk.testing.breadth_models`` (the list tests/models/test_hf_breadth.py runs on the CPU
executor) compiled whole in strict mode (``fallback="error"``) on the GPU executor in
bfloat16 — one persistent kernel, one nvcc build each (~20 s; the builds parallelise under
pytest-xdist, ``-n``) — against a float32 eager reference of the same weights.

Reference: the bf16 model's own weights and bf16-rounded inputs, upcast to float32 and run by
eager PyTorch on the CPU (no TF32 there: cuDNN's float32 convolutions on the GPU may use it),
so the difference is the roundings of mpk's bf16 computation alone.

Tolerance, from bf16's 8 significant bits (unit roundoff u = 2^-8) and the model's depth:

* a bound: each residual block (a transformer layer, a conv block) rounds an output's way to
  bf16 about ``ROUNDINGS_PER_BLOCK`` = 30 times (a Llama layer counted: the norms 2 + 2, the
  projections' outputs 5, RoPE 2 of gain √2, scores, softmax 2, P, P·V, SiLU·mul 2.28, the
  residual adds 2, …; a basic conv block has fewer), plus ``ROUNDINGS_OUTSIDE`` = 6 for the
  embedding, final norm and head. Rounding errors of random data have no common sign, so they
  add like a random walk (the argument ``mpk.testing.tolerance`` makes for a dot product's
  operands): ≈ u·√n in rms for n roundings; the largest of a few thousand outputs relative to
  the largest |ref| stays within 4× that. ``bound = 4·u·√(30·blocks + 6)``: 0.09 for one
  layer, 0.26 for ResNet-18's nine blocks. Measured with the CPU executor in bf16 (whose
  tasks round to bf16 where the GPU's do), these models' errors are 0.002–0.010.
* against eager bf16 on the GPU, the same computation's usual error: mpk's may differ from
  eager's (other fusion, other summation orders) but not by more than 2× plus 2u; a wrong
  mask, position or op shows as errors of 0.1–1, far beyond either.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mpk.testing.breadth_models import MODELS, build, compared, inputs
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import unit_roundoff

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
DEV = "cuda"
OPTS = {"executor": "gpu", "fallback": "error"}
U = unit_roundoff(torch.bfloat16)
ROUNDINGS_PER_BLOCK, ROUNDINGS_OUTSIDE = 30, 6
# none of the suite's models is known not to run on the GPU executor: each traces whole with
# executor="gpu" in bf16 and its kernel builds for sm_90a with nvcc (checked without a GPU)
NOT_ON_GPU: dict[str, str] = {}


def _bound(name: str) -> float:
    return 4 * U * math.sqrt(ROUNDINGS_PER_BLOCK * MODELS[name].blocks + ROUNDINGS_OUTSIDE)


def _to(x, device: str, dtype: torch.dtype):
    """A tensor argument on ``device``; floating ones in ``dtype`` (token ids and masks keep theirs)."""
    if not torch.is_tensor(x):
        return x
    return x.to(device, dtype) if x.is_floating_point() else x.to(device)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skip(reason=NOT_ON_GPU[n])) if n in NOT_ON_GPU
                                  else n for n in MODELS])
def test_bf16_model_matches_float32_reference(name):
    model = build(name).to(torch.bfloat16)
    args, kwargs = inputs(name)
    args = tuple(_to(a, "cpu", torch.bfloat16) for a in args)
    reference = copy.deepcopy(model).float()  # the same (bf16-valued) weights, computed in float32
    with torch.no_grad():
        ref = compared(name, reference(*(_to(a, "cpu", torch.float32) for a in args), **kwargs))
        model = model.to(DEV)
        dev_args = tuple(_to(a, DEV, torch.bfloat16) for a in args)
        dev_kwargs = {k: _to(v, DEV, torch.bfloat16) for k, v in kwargs.items()}
        eager = compared(name, model(*dev_args, **dev_kwargs))
        torch._dynamo.reset()
        out = compared(name, torch.compile(model, backend="mpk", fullgraph=True, options=OPTS)(*dev_args,
                                                                                                 **dev_kwargs))
    assert len(out) == len(ref)
    bound = _bound(name)
    for i, (o, e, r) in enumerate(zip(out, eager, ref)):
        assert o.shape == r.shape and o.dtype == torch.bfloat16, (i, o.shape, o.dtype)
        err, eager_err = relative_error(o.cpu(), r), relative_error(e.cpu(), r)
        assert err <= bound, f"output {i}: {err:.4f} > the bf16 bound {bound:.4f}"
        assert err <= 2 * eager_err + 2 * U, f"output {i}: {err:.4f}; eager bf16's {eager_err:.4f}"
