"""The generated kernel of a sharded graph, with its collective tasks (cuda/mpk_tasks/comm.cuh),
compiles with nvcc for sm_90a (CI has nvcc, no GPU)."""

import pytest
import torch

from mpk.compiler import compile_graph
from mpk.distributed.shard import shard_graph
from mpk.executors import build
from mpk.executors.codegen import generate
from mpk.testing.tp import traced_step


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_sharded_decode_kernel_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    step = traced_step("qwen3", False, 0, lens=[5, 3], head_dim=64, dtype=torch.bfloat16)
    sharded = shard_graph(step.compiled.graph, 1, 2)
    src = generate(compile_graph(sharded.graph, 8, check=True).tables)
    for task in ("comm_put", "comm_reduce", "comm_gather"):
        assert f"mpk::{task}<__nv_bfloat16>" in src
    assert build.build_cubin(src, "sm_90a").read_bytes()[:4] == b"\x7fELF"
