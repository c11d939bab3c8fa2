"""``benchmarks/decode_latency.py --tp N`` on the CPU: its arguments (a degree the model's
sizes do not divide, fewer GPUs than ranks, not under torchrun) are refused with a message
and a non-zero status; and the peer's Megatron shard (``PeerDecoder.shard_``), its ranks run
in threads whose all-reduce is a sum over the threads, gives the whole model's logits."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading

import pytest
import torch

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolves the module of peer.Shape by name
    spec.loader.exec_module(module)
    return module


peer = _load("peer")


def test_too_few_gpus_are_named_and_the_run_fails(capsys, monkeypatch):
    bench = _load("decode_latency")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # (also on a one-GPU machine)
    assert bench.main(["--tp", "2", "--models", "qwen3-1.7b"]) == 1
    assert "--tp 2 needs 2 GPUs, one per rank; 1 visible" in capsys.readouterr().err


def test_tp_arguments_are_checked_before_any_work(capsys):
    bench = _load("decode_latency")
    assert "q_heads=16 is not divisible by the tensor-parallel degree 3" in bench.check_tp(3, ["qwen3-1.7b"], 8)
    assert "kv_heads=8 is not divisible by the tensor-parallel degree 16" in bench.check_tp(16, ["qwen3-8b"], 16)
    assert "torchrun --nproc-per-node 4" in bench.check_tp(4, ["qwen3-8b"], visible=8)
    assert bench.check_tp(1, ["qwen3-8b"], visible=0) is None
    with pytest.raises(SystemExit) as e:
        bench.main(["--tp", "0"])
    assert e.value.code == 2 and "'0': expected an integer >= 1" in capsys.readouterr().err


class _ThreadSum:
    """An all-reduce over ``world`` threads: each deposits its part and gets the sum, added in
    rank order (every rank the same bits)."""

    def __init__(self, world: int):
        self.barrier, self.parts = threading.Barrier(world, timeout=60), [None] * world

    def of(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0])
            self.barrier.wait()  # nobody deposits the next part before every rank has summed this one
            return total
        return reduce


@pytest.mark.parametrize("world", [2, 4])
def test_the_sharded_peer_gives_the_whole_models_logits(world):
    shape = peer.Shape("toy", 64, 128, 2, 8, 4, 16, 97, False, True, 1e4)
    tokens, pos = torch.tensor([3, 41]), torch.tensor([5])

    def model() -> torch.nn.Module:
        m = peer.PeerDecoder(shape, 2, 16, "cpu", dtype=torch.float32, seed=1).eval()
        m.fill_cache_(5, seed=2)
        return m

    with torch.no_grad():
        whole = model()(tokens, pos)
        reduce, out = _ThreadSum(world), [None] * world

        def rank(r: int) -> None:
            with torch.no_grad():
                out[r] = model().shard_(r, world, reduce.of(r))(tokens, pos)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(torch.equal(o, out[0]) for o in out)
    torch.testing.assert_close(out[0], whole, rtol=1e-5, atol=1e-5)
    small = model().shard_(1, world, reduce.of(1))
    assert small.layers[0].wqkv.shape == ((8 + 2 * 4) // world * 16, 64)
    assert small.layers[0].k_cache.shape[1] == 4 // world
    with pytest.raises(ValueError, match="kv_heads=4 is not divisible by the tensor-parallel degree 8"):
        model().shard_(0, 8)
