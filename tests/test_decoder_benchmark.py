"""The decoder benchmark's Hugging Face half (kernels/decoder/benchmark_hf.py, its child process) on
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
from kernels.decoder import benchmark, benchmark_hf, hf_reference
from kernels.decoder.config import TINY


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
    assert benchmark_hf.hf_child(str(path), quick=False) == 0
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
    steps = benchmark_hf.HFSteps(hf, 3, 9, compiled=True)
    for _ in range(4):  # 4 rounds of 4 steps: 16 > 2 * STEPS, the cache's headroom
        steps.reset_dynamic()
        steps.reset_static()
        assert all(int(layer.cumulative_length) == 9 for layer in steps.static.layers)
        for _ in range(2 * benchmark.STEPS):
            assert torch.equal(steps.eager_step(), steps.static_step())
        assert steps.dynamic.get_seq_length() == 9 + 2 * benchmark.STEPS


class FakeGraph:
    """Stands in for DecodeGraph on the CPU (no CUDA graphs here): it records which projections
    the model ran on the GEMV when it was captured, and counts its replays."""

    def __init__(self, model, batch):
        self.batch = batch
        self.gemv = model.decode_gemv.get(batch, frozenset())
        self.positions = torch.zeros(batch, dtype=torch.int32)
        self.tokens = torch.zeros(batch, dtype=torch.int64)
        self.replays = 0

    def start(self, tokens, length):
        self.tokens.copy_(tokens)
        self.positions.fill_(length)

    def replay(self):
        self.replays += 1
        self.positions.add_(1)
        return self.tokens


def test_decode_rows_time_the_measured_choice_beside_cublas(tiny_benchmark, monkeypatch):
    """The choice of projections is made per batch of DECODE and kept by the model; the sweep and
    the decode rows time a graph captured with it and one captured on cuBLAS only (one graph where
    the choice kept no GEMV), and the headline columns are the choice's."""
    from kernels.decoder.config import PROJECTIONS
    from kernels.decoder.model import Decoder, DecoderWeights

    monkeypatch.setattr(benchmark, "SWEEP_CONTEXTS", (8, 16))
    monkeypatch.setattr(benchmark, "SWEEP_BATCHES", (1, 2, 4))
    hf = hf_reference.random_llama(TINY, seed=22, dtype=torch.bfloat16)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=4, max_seq=64)
    captured = []

    def capture(batch):
        model._graph = FakeGraph(model, batch)
        captured.append(model._graph)
        return model._graph

    def choose(batch):  # what Decoder.choose_decode_linears does, with made-up times
        won = {"o", "down"} if batch == 1 else set()
        measured = {
            p: {
                "cublas_us": 2.0,
                "gemv_us": 1.0 if p in won else 3.0,
                "speedup": 1.0,
                "gemv": p in won,
            }
            for p in PROJECTIONS
        }
        model.set_decode_linears(batch, won)
        return measured

    monkeypatch.setattr(model, "capture_decode_graph", capture)
    monkeypatch.setattr(model, "choose_decode_linears", choose)
    ceilings = {"copy_gbps": 1.0}

    rows = benchmark.choose_linears(model, [1, 1, 2, 8])  # 8 > max_batch: left out
    assert [(r["batch"], r["projection"]) for r in rows] == [
        (b, p) for b in (1, 2) for p in PROJECTIONS
    ]
    assert model.decode_gemv == {1: {"o", "down"}, 2: set()}

    sweep = benchmark.sweep(model, ceilings)
    assert [(r["batch"], r["context"]) for r in sweep] == [(1, 8), (1, 16), (2, 512), (4, 512)]
    assert [r["linears"] for r in sweep] == ["GEMV for o, down"] * 2 + ["cuBLAS"] * 2
    assert [g.gemv for g in captured] == [set(), {"o", "down"}, set(), set()]
    assert all(r["graph GPU ms"] > 0 and r["graph GPU ms (cuBLAS)"] > 0 for r in sweep)

    captured.clear()
    one = benchmark.decode_ours(model, 1, 12, ceilings)
    assert [g.gemv for g in captured] == [set(), {"o", "down"}]
    assert all(g.replays > 0 for g in captured)
    assert model._graph is captured[1] and model.decode_gemv[1] == {"o", "down"}
    assert one["linears"] == "GEMV for o, down"
    assert one["ours % of floor"] == pytest.approx(100 * one["floor ms"] / one["ours (graph) ms"])
    captured.clear()
    two = benchmark.decode_ours(model, 2, 9, ceilings)
    assert len(captured) == 1 and two["linears"] == "cuBLAS"
    assert two["ours (graph, cuBLAS) ms"] == two["ours (graph) ms"]
    assert two["ours (graph, cuBLAS) GPU ms"] == two["ours (graph) GPU ms"]

    merged = benchmark.merge([one, two], [{"batch": 1, "context": 12, "HF eager ms": 5.0}])
    assert merged[0]["ours vs HF eager"] == pytest.approx(5.0 / one["ours (graph) ms"])
    targets = benchmark.performance_targets(merged, [], None)
    assert targets[0]["value"] == f"{one['ours % of floor']:.1f}%"
