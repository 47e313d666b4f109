"""The decoder benchmark's Hugging Face half (kernels/decoder/benchmark.py, its child process) on
the tiny model: every part of the child runs, with the static-cache step called eagerly (the same
cache, positions and resets as the compiled step, without torch.compile).

A static cache that a reset does not rewind fills up after a few rounds: on the CPU the write past
its end raises an IndexError in index_copy_, on a GPU it is a device-side assert that also poisons
every later part of the child."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from kernels import runtime
from kernels.decoder import benchmark, hf_reference
from kernels.decoder.model import TINY


@pytest.fixture
def tiny_benchmark(monkeypatch):
    """The benchmark's constants at the tiny model's scale; the static step eager."""
    monkeypatch.setattr(benchmark, "CONFIG", TINY)
    monkeypatch.setattr(benchmark, "DTYPE", torch.float32)
    monkeypatch.setattr(benchmark, "STEPS", 2)
    monkeypatch.setattr(benchmark, "ROUNDS", 3)  # each round's steps would overflow 2 * STEPS
    monkeypatch.setattr(benchmark, "DECODE", ((1, 12), (3, 9)))
    monkeypatch.setattr(benchmark, "PREFILL", ((1, 8), (2, 5)))
    monkeypatch.setattr(benchmark, "MEMORY", (3, 10))
    monkeypatch.setattr(LlamaForCausalLM, "get_compiled_call", lambda self, config: self.__call__)
    if not runtime.ON_GPU:  # memory_hf's allocator statistics: CUDA's only
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)


def test_hf_child_runs_every_part(tiny_benchmark, tmp_path):
    """The child's decode (eager and static, every configuration, several timed rounds), prefill and
    memory parts all finish with no error recorded."""
    path = tmp_path / "hf.json"
    assert benchmark.hf_child(str(path), quick=False) == 0
    out = json.loads(path.read_text())
    assert out["errors"] == {}
    assert [(r["batch"], r["context"]) for r in out["decode"]] == list(benchmark.DECODE)
    for row in out["decode"]:
        assert row["HF eager ms"] > 0 and row["HF static compiled ms"] > 0
    assert [(r["batch"], r["tokens"]) for r in out["prefill"]] == list(benchmark.PREFILL)
    assert out["memory"]["HF static cache GiB"] > 0


def test_static_steps_match_dynamic_steps_after_every_reset(tiny_benchmark):
    """After each reset both caches hold `context` tokens again: the static step (fixed-size cache,
    masked) picks the same tokens as the eager DynamicCache step, round after round, and the static
    cache's write position is back at the context."""
    hf = hf_reference.random_llama(TINY, seed=21, device=runtime.DEVICE)
    steps = benchmark.HFSteps(hf, 3, 9, compiled=True)
    for _ in range(4):  # 4 rounds of 4 steps: 16 > 2 * STEPS, the cache's headroom
        steps.reset_dynamic()
        steps.reset_static()
        assert all(int(layer.cumulative_length) == 9 for layer in steps.static.layers)
        for _ in range(2 * benchmark.STEPS):
            assert torch.equal(steps.eager_step(), steps.static_step())
        assert steps.dynamic.get_seq_length() == 9 + 2 * benchmark.STEPS
