"""The decoder at Llama-3.2-1B's shape (bf16, random weights) against Hugging Face, in one run.

Run on a GPU: `python -m kernels.decoder.benchmark` writes data/results/<gpu>/07_decoder.json (with
the environment fingerprint) and prints the targets (at most about 7 minutes on an H100, most of it
torch.compile); `--quick` measures batch 1 at context 512 only; `--pdl` only the graph step with
and without programmatic dependent launch at PDL_DECODE (07_decoder_pdl.json, PERFORMANCE.md 5.1).

Ours first, in this process:
* the lab's kernels (RoPE, argmax, RoPE in CUDA C) against PyTorch's, timed as the grader does;
* the decode step's projections: at each batch of DECODE (1, 8, 32), `Decoder.choose_decode_linears`
  times cuBLAS against the course GEMV (triton_gemv.py) on every projection's weight and the model
  keeps the GEMV where it won in this run ("decode_linears": both times per projection and the
  choice), then `Decoder.choose_decode_fused` captures the whole step with every subset of the
  normed projections (qkv, gate_up, lm_head) fused with their norm and keeps the fastest
  ("decode_fused"). Every decode number below is for that choice, with the step on cuBLAS and the
  norms apart beside it;
  the sweep's other batches (2, 4, 16) run cuBLAS only: a choice there would add an autotuning of
  the GEMV per projection and batch to the run, for points of a plot;
* the decode step replayed from one CUDA graph across contexts and batches (device events) against
  the floor: every weight and the context's K and V read once at the measured copy bandwidth;
* decode per token as generation pays it: the wall time of a loop of steps synchronized at its end,
  the graph with the choice and the graph on cuBLAS only interleaved round by round, then the
  eager step (module 03's attention); the graph step again captured with PDL between its kernels
  (pdl.py), checked for the same logits and timed interleaved with the default graph;
* prefill against the GEMM floor (flops at the measured bf16 matmul rate): its latency (single calls
  synchronized on both sides) and its GPU time (device events);
* the eager step's host time split by wrapper, the GPU time per kernel of a decode step (graph and
  eager, batch 1's choice) and of a prefill (torch.profiler), the peak memory of batch 32 at a
  4096-token context.

Then Hugging Face's LlamaForCausalLM, in a child process (benchmark_hf.py: a fault there cannot
touch our numbers, and torch.compile's CUDA-graph pools stay out of ours): eager with a
DynamicCache, and a StaticCache with the forward compiled as `generate` compiles it, its prefill
and its peak memory with a static cache. Both sides time the same way (wall_per_call_ms,
prefill_times); this process merges the rows and states the targets (ours: the decode step with the
measured choice).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict

import torch
import torch.nn.functional as F

from kernels import bench, runtime
from kernels.decoder import (
    hf_reference,
    pdl,
    triton_attention,
    triton_fused_gemv,
    triton_gemv,
    triton_ops,
    triton_rope,
)
from kernels.decoder.config import LLAMA_1B, PROJECTIONS
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.flash_attention import triton_decode, triton_flash
from kernels.rmsnorm import triton_rmsnorm

CONFIG = LLAMA_1B
DTYPE = torch.bfloat16
DECODE = ((1, 512), (1, 4096), (8, 512), (32, 512))  # (batch, context)
PREFILL = ((1, 2048), (8, 512))
MEMORY = (32, 4096)
PDL_DECODE = ((1, 512), (1, 4096), (8, 512))  # (batch, context): the graph with and without PDL
STEPS = 16  # decode steps per timed loop
ROUNDS = 5
MAX_SEQ = 4096 + 2 * STEPS + 16
SWEEP_CONTEXTS = (128, 512, 1024, 2048, 4096)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)
HF_TIMEOUT_S = 300  # the Hugging Face child process (mostly torch.compile)
DEVICE = runtime.DEVICE  # "cuda"; the CPU runs pieces of this file on a tiny model in tests


def sync() -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if runtime.ON_GPU:
        torch.cuda.synchronize()


def decode_bytes(batch: int, context: int) -> int:
    """One decode step's compulsory reads: every weight once (the tied embedding once, as lm_head)
    and the K and V of the context, for every sequence."""
    c = CONFIG
    kv = 2 * c.n_layers * batch * c.n_kv_heads * context * c.head_dim
    return (c.n_parameters() + kv) * DTYPE.itemsize


def prefill_flops(batch: int, tokens: int) -> float:
    """GEMMs (2 flops per weight per token, lm_head for the last token only) + causal attention."""
    c = CONFIG
    weights = c.n_parameters() - c.vocab_size * c.hidden_size  # the embedding gather is no GEMM
    attention = 4 * c.n_layers * batch * c.n_heads * c.head_dim * tokens * tokens / 2
    return 2 * batch * tokens * weights + 2 * batch * c.hidden_size * c.vocab_size + attention


def wall_per_call_ms(fns: dict, before: dict, calls: int | None = None, rounds: int | None = None):
    """Median over rounds of (wall time of `calls` back-to-back calls, synchronized at the end) /
    calls; the functions interleaved round by round, `before[name]()` run untimed ahead of each.
    `calls` and `rounds` default to STEPS and ROUNDS as they are when called."""
    calls, rounds = calls or STEPS, rounds or ROUNDS
    times = defaultdict(list)
    for name, fn in fns.items():  # warm-up
        before[name]()
        fn()
    for r in range(rounds):
        for name, fn in fns.items():
            before[name]()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3 / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def graph_for(model: Decoder, batch: int):
    """The model's captured decode step for this batch (captured now if it has another)."""
    if model._graph is not None and model._graph.batch == batch:
        return model._graph
    return model.capture_decode_graph(batch)


def decode_floor_ms(batch: int, context: int, ceilings: dict) -> float:
    """The step's compulsory bytes at the measured copy rate."""
    return decode_bytes(batch, context) / (ceilings["copy_gbps"] * 1e9) * 1e3


def linears_label(model: Decoder, batch: int) -> str:
    """Which kernel the decode step of `batch` runs its projections on, in words."""
    gemv = model.decode_gemv.get(batch, frozenset())
    fused = model.decode_fused.get(batch, frozenset())
    label = "GEMV for " + ", ".join(p for p in PROJECTIONS if p in gemv) if gemv else "cuBLAS"
    return label + (f"; norm fused into {', '.join(sorted(fused))}" if fused else "")


def choose_linears(model: Decoder, batches) -> list[dict]:
    """Decoder.choose_decode_linears at each batch: cuBLAS against the course GEMV on every
    projection's weight, the GEMV kept where it won; one row per (batch, projection)."""
    rows = []
    for batch in dict.fromkeys(b for b in batches if b <= model.max_batch):
        measured = model.choose_decode_linears(batch)
        for projection, m in measured.items():
            rows.append(
                {
                    "batch": batch,
                    "projection": projection,
                    "cuBLAS us": m["cublas_us"],
                    "GEMV us": m["gemv_us"],
                    "GEMV speedup": m["speedup"],
                    "GEMV kept": m["gemv"],
                }
            )
        if not measured:  # the GEMV does not take this batch (or this dtype): cuBLAS
            rows.append({"batch": batch, "projection": "all", "GEMV kept": False})
    return rows


def choose_fused(model: Decoder, batches) -> list[dict]:
    """Decoder.choose_decode_fused at each batch (after choose_linears): the whole graph step for
    every subset of the normed projections fused, the fastest kept; one row per (batch, subset)."""
    rows = []
    for batch in dict.fromkeys(b for b in batches if b <= model.max_batch):
        step_us = model.choose_decode_fused(batch)
        for fused, us in step_us.items():
            kept = model.decode_fused[batch] == frozenset(fused.split("+")) - {"none"}
            rows.append({"batch": batch, "fused": fused, "step us": us, "kept": kept})
    return rows


def decode_graphs(model: Decoder, batch: int) -> dict:
    """The decode step of `batch` captured twice: "cuBLAS" (every projection on cuBLAS, the norms
    apart) and "choice" (the model's measured choice of GEMV and fusion; the same graph where it
    kept neither). The model keeps its choice, and the choice's graph as its own."""
    gemv = model.decode_gemv.get(batch, frozenset())
    fused = model.decode_fused.get(batch, frozenset())
    model.set_decode_linears(batch, ())
    model.set_decode_fused(batch, ())
    cublas = model.capture_decode_graph(batch)
    if not gemv and not fused:
        return {"cuBLAS": cublas, "choice": cublas}
    model.set_decode_linears(batch, gemv)
    model.set_decode_fused(batch, fused)
    return {"cuBLAS": cublas, "choice": model.capture_decode_graph(batch)}


def start_graphs(graphs: dict, context: int) -> None:
    """Start each captured step on random tokens at position `context`."""
    for step in dict.fromkeys(graphs.values()):
        tokens = torch.randint(0, CONFIG.vocab_size, (step.batch,), device=DEVICE)
        step.start(tokens, context)


def graphs_gpu_ms(graphs: dict, context: int) -> dict:
    """Device time of one replay of each graph (events, 20 repetitions, the graphs interleaved),
    the positions reset to `context` before each round so that every replay reads the same cache
    length. A graph listed twice is timed once."""
    first = {}  # each distinct graph -> the first name it has
    for name, step in graphs.items():
        first.setdefault(id(step), name)
    distinct = {name: graphs[name] for name in first.values()}
    times = bench.benchmark(
        {name: step.replay for name, step in distinct.items()},
        reps=20,
        flush=False,
        before_round=lambda: [step.positions.fill_(context) for step in distinct.values()],
    )
    return {name: times[first[id(step)]].median_us / 1e3 for name, step in graphs.items()}


def decode_ours(model: Decoder, batch: int, context: int, ceilings: dict) -> dict:
    """The graph's step per token, with the measured choice of projections and with cuBLAS only:
    wall time of a loop of replays (the two interleaved round by round), and device time of one."""
    graphs = decode_graphs(model, batch)
    start_graphs(graphs, context)
    names = {"choice": "ours (graph)", "cuBLAS": "ours (graph, cuBLAS)"}
    same = graphs["choice"] is graphs["cuBLAS"]
    timed = {"choice": graphs["choice"]} if same else graphs
    ms = wall_per_call_ms(
        {names[k]: step.replay for k, step in timed.items()},
        {names[k]: (lambda step=step: step.positions.fill_(context)) for k, step in timed.items()},
    )
    if same:
        ms[names["cuBLAS"]] = ms[names["choice"]]
    gpu = graphs_gpu_ms(graphs, context)
    floor_ms = decode_floor_ms(batch, context, ceilings)
    mine = ms["ours (graph)"]
    return {
        "batch": batch,
        "context": context,
        "bytes": decode_bytes(batch, context),
        "floor ms": floor_ms,
        "ours (graph) ms": mine,
        "ours (graph, cuBLAS) ms": ms["ours (graph, cuBLAS)"],
        "ours (graph) GPU ms": gpu["choice"],
        "ours (graph, cuBLAS) GPU ms": gpu["cuBLAS"],
        "choice vs cuBLAS": ms["ours (graph, cuBLAS)"] / mine,
        "linears": linears_label(model, batch),
        "ours % of floor": 100 * floor_ms / mine,
        "tokens/s (graph)": batch / mine * 1e3,
    }


def decode_pdl(model: Decoder, batch: int, context: int, ceilings: dict) -> dict:
    """The graph step with the model's choice of projections, captured without and with
    programmatic dependent launch (pdl.py, PERFORMANCE.md 5.1): one replay of each from the same
    tokens must give the same logits bit for bit, then both are timed interleaved (device time of
    one replay, wall time per token of a loop). The model keeps its default graph."""
    row = {"batch": batch, "context": context, "linears": linears_label(model, batch)}
    if not pdl.available():
        return row | {"PDL": "not available on this GPU (sm_90 and newer): not timed"}
    with_pdl = model.capture_decode_graph(batch, pdl=True)
    graphs = {"default": model.capture_decode_graph(batch, pdl=False), "PDL": with_pdl}
    start_graphs({"default": graphs["default"]}, context)
    graphs["PDL"].start(graphs["default"].tokens, context)
    for step in graphs.values():
        step.replay()
    same = torch.equal(graphs["default"].logits, graphs["PDL"].logits)
    gpu = graphs_gpu_ms(graphs, context)
    ms = wall_per_call_ms(
        {name: step.replay for name, step in graphs.items()},
        {name: (lambda step=step: step.positions.fill_(context)) for name, step in graphs.items()},
    )
    floor_ms = decode_floor_ms(batch, context, ceilings)
    return row | {
        "same logits": same,
        "graph GPU ms": gpu["default"],
        "graph PDL GPU ms": gpu["PDL"],
        "PDL saving GPU us": (gpu["default"] - gpu["PDL"]) * 1e3,
        "graph ms": ms["default"],
        "graph PDL ms": ms["PDL"],
        "PDL speedup": ms["default"] / ms["PDL"],
        "PDL % of floor": 100 * floor_ms / ms["PDL"],
    }


def decode_eager(model: Decoder, batch: int, context: int) -> dict:
    """The same step launched from Python, per token (module 03's flash-decoding inside)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch,), device=DEVICE)

    def reset():
        model.cache.length = context

    ms = wall_per_call_ms(
        {"ours (eager)": lambda: model.decode_step(tokens)}, {"ours (eager)": reset}
    )
    model.cache.length = 0
    return {"batch": batch, "context": context, "ours (eager) ms": ms["ours (eager)"]}


def prefill_times(fn) -> tuple[float, float]:
    """(latency, GPU time) of a prefill in ms: the median of single calls synchronized on both
    sides (what the first token waits for, the host's launches included), and of device events
    around calls queued behind a GPU spin (bench.benchmark: the host's launches hidden, unless the
    call itself synchronizes)."""
    reps = 2 * ROUNDS  # as read when called (tests shrink ROUNDS)
    latency = wall_per_call_ms({"prefill": fn}, {"prefill": lambda: None}, calls=1, rounds=reps)
    gpu = bench.benchmark({"prefill": fn}, reps=reps)["prefill"]
    return latency["prefill"], gpu.median_us / 1e3


def prefill_ours(model: Decoder, batch: int, tokens: int, ceilings: dict) -> dict:
    prompt = torch.randint(0, CONFIG.vocab_size, (batch, tokens), device=DEVICE)
    ms, gpu_ms = prefill_times(lambda: model.prefill(prompt))
    model.check_status()
    flops = prefill_flops(batch, tokens)
    floor_ms = flops / (ceilings["matmul_bf16_tflops"] * 1e12) * 1e3
    model.reset()
    return {
        "batch": batch,
        "tokens": tokens,
        "flops": flops,
        "floor ms": floor_ms,
        "ours ms": ms,
        "ours GPU ms": gpu_ms,
        "ours % of floor": 100 * floor_ms / ms,
        "ours TFLOP/s": flops / ms / 1e9,
    }


WRAPPERS = {
    "embedding": (triton_ops, "embedding"),
    "swiglu": (triton_ops, "swiglu"),
    "argmax": (triton_ops, "argmax"),
    "rope_append": (triton_rope, "rope_append"),
    "rms_norm": (triton_rmsnorm, "rms_norm"),
    "fused_add_rms_norm": (triton_rmsnorm, "fused_add_rms_norm"),
    "flash_decode": (triton_decode, "flash_decode"),
    "flash_attention_forward": (triton_flash, "flash_attention_forward"),
    "cache_attention": (triton_attention, "cache_attention"),
    "linear (course GEMV)": (triton_gemv, "linear"),
    "norm + linear (course fused GEMV)": (triton_fused_gemv, "add_rms_norm_linear"),
    "F.linear (cuBLAS)": (F, "linear"),
}


def host_breakdown(model: Decoder, batch: int = 1, context: int = 512, steps: int = 50) -> dict:
    """Host time of the eager decode step (no synchronization inside), and each wrapper's share:
    every wrapper the step calls is timed from call to return (for an asynchronous launch, that is
    its host cost). The shares are of the timed pass's own step time: a second pass, with the
    timers in, is not the first pass's time (on the CPU, where a "launch" runs the interpreter, the
    two differ by more than the timers)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch,), device=DEVICE)
    spent = defaultdict(float)
    calls = defaultdict(int)
    originals = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return out

        return wrapper

    model.cache.length = context
    for _ in range(3):
        triton_ops.argmax(model.decode_step(tokens))
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.cache.length = context
        triton_ops.argmax(model.decode_step(tokens))
    host_us = (time.perf_counter() - t0) / steps * 1e6  # the GPU keeps up: this is the host's time
    sync()
    for name, (module, attr) in WRAPPERS.items():
        originals[name] = getattr(module, attr)
        setattr(module, attr, timed(name, originals[name]))
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            model.cache.length = context
            triton_ops.argmax(model.decode_step(tokens))
        timed_us = (time.perf_counter() - t0) / steps * 1e6
        sync()
    finally:
        for name, (module, attr) in WRAPPERS.items():
            setattr(module, attr, originals[name])
    model.cache.length = 0
    per_step = {k: v / steps * 1e6 for k, v in spent.items()}
    return {
        "batch": batch,
        "context": context,
        "eager step host us": host_us,
        "eager step host us, wrappers timed": timed_us,
        "wrappers us per step": per_step,
        "calls per step": {k: v // steps for k, v in calls.items()},
        "course wrappers share": sum(v for k, v in per_step.items() if "F.linear" not in k)
        / timed_us,
    }


def kernel_breakdown(fn, label: str) -> list[dict]:
    """GPU time per kernel (summed over launches) of one call of `fn`, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count:
            rows.append({"what": label, "kernel": e.key[:90], "us": us, "launches": e.count})
    return sorted(rows, key=lambda r: -r["us"])


def footprint(tensors) -> int:
    """Bytes of the distinct storages among `tensors`."""
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def memory_ours(model: Decoder, batch: int, context: int) -> dict:
    """Weights + cache + the transient peak of one graph replay at (batch, context)."""
    w = model.w
    weights = footprint(
        [w.embed, w.norm, w.lm_head]
        + [
            t
            for layer in w.layers
            for t in (
                layer.attn_norm,
                layer.qkv,
                layer.o,
                layer.mlp_norm,
                layer.gate_up,
                layer.down,
            )
        ]
    )
    step = graph_for(model, batch)
    step.start(torch.zeros(batch, dtype=torch.int64, device=DEVICE), context)
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step.replay()
    sync()
    transient = torch.cuda.max_memory_allocated() - base
    cache = model.cache.nbytes()
    gib = 2**30
    return {
        "batch": batch,
        "context": context,
        "ours weights GiB": weights / gib,
        "ours cache GiB": cache / gib,
        "ours step transient GiB": transient / gib,
        "ours total GiB": (weights + cache + transient) / gib,
    }


def merge(ours: list[dict], theirs: list[dict], keys=("batch", "context")) -> list[dict]:
    """Our rows with Hugging Face's columns of the same configuration, and the ratios."""
    by_key = {tuple(r[k] for k in keys): r for r in theirs or []}
    merged = []
    for row in ours or []:
        hf = by_key.get(tuple(row[k] for k in keys), {})
        row = {**row, **{k: v for k, v in hf.items() if k not in keys}}
        mine = row.get("ours (graph) ms", row.get("ours ms"))
        for name in ("HF eager", "HF static compiled"):
            if isinstance(row.get(f"{name} ms"), float) and mine:
                row[f"ours vs {name}"] = row[f"{name} ms"] / mine
        merged.append(row)
    return merged


def performance_targets(decode: list[dict], prefill: list[dict], memory: dict | None) -> list[dict]:
    targets = []
    for r in decode:
        if r["batch"] == 1:
            targets.append(
                {
                    "target": f"decode b1 ctx {r['context']}: >= 85% of the floor",
                    "value": f"{r['ours % of floor']:.1f}%",
                    "met": r["ours % of floor"] >= 85,
                }
            )
        ratio = r.get("ours vs HF static compiled")
        targets.append(
            {
                "target": f"decode b{r['batch']} ctx {r['context']}: faster than HF "
                "static compiled",
                "value": f"{ratio:.2f}x" if ratio else "not measured",
                "met": bool(ratio and ratio > 1),
            }
        )
    for r in prefill:
        ratio = r.get("ours vs HF eager")
        targets.append(
            {
                "target": f"prefill {r['batch']}x{r['tokens']}: >= 1.1x HF eager",
                "value": f"{ratio:.2f}x" if ratio else "not measured",
                "met": bool(ratio and ratio >= 1.1),
            }
        )
    if memory and "HF total GiB" in memory:
        targets.append(
            {
                "target": "peak memory b32 x 4096 <= HF with a static cache",
                "value": f"{memory['ours total GiB']:.2f} vs {memory['HF total GiB']:.2f} GiB",
                "met": memory["ours total GiB"] <= memory["HF total GiB"],
            }
        )
    return targets


def sweep(model: Decoder, ceilings: dict) -> list[dict]:
    """GPU time of the graph's decode step (device events) across contexts at batch 1 and across
    batches at context 512, beside the floor: the data of the tokens/s plots. "graph GPU ms" is the
    step with the model's measured choice of projections where one was measured (the batches of
    DECODE), cuBLAS elsewhere ("linears" says which); "graph GPU ms (cuBLAS)" is cuBLAS only."""
    rows = []
    points = [(1, c) for c in SWEEP_CONTEXTS] + [(b, 512) for b in SWEEP_BATCHES if b > 1]
    for batch in dict.fromkeys(b for b, _ in points):
        if batch > model.max_batch:
            continue
        graphs = decode_graphs(model, batch)
        for context in [c for b, c in points if b == batch]:
            start_graphs(graphs, context)
            ms = graphs_gpu_ms(graphs, context)
            floor_ms = decode_floor_ms(batch, context, ceilings)
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "graph GPU ms": ms["choice"],
                    "graph GPU ms (cuBLAS)": ms["cuBLAS"],
                    "linears": linears_label(model, batch),
                    "floor ms": floor_ms,
                    "% of floor": 100 * floor_ms / ms["choice"],
                    "tokens/s": batch / ms["choice"] * 1e3,
                }
            )
        del graphs  # the next batch's graphs take the model's place
    return rows


def lab_kernels(ceilings: dict) -> list[dict]:
    """The lab's performance configurations: the course's RoPE and argmax against PyTorch's (the
    rows of data/expected/07_decoder.yaml), timed as the grader does (interleaved, L2 flushed)."""
    from grading.labs import lab07_decoder as lab

    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for spec in lab.LAB.functions:
        for perf in spec.perf:
            inputs = spec.make_inputs(perf.shape, perf.dtype, DEVICE, gen)
            if spec.output_shapes is None:
                out = torch.empty(perf.shape, dtype=perf.dtype, device=DEVICE)
            else:
                ((shape, dtype),) = spec.output_shapes(perf.shape, perf.dtype)
                out = torch.empty(shape, dtype=dtype, device=DEVICE)
            t = bench.benchmark(
                {
                    "course": lambda: spec.course_kernel(*inputs, out=out),
                    "torch": lambda: spec.torch_native(*inputs),
                }
            )
            nbytes = spec.bytes_moved(*inputs)
            rows.append(
                {
                    "function": spec.name,
                    "config": perf.id,
                    "reference_us": t["course"].median_us,
                    "torch_us": t["torch"].median_us,
                    "reference_gbps": t["course"].gbps(nbytes),
                    "% of copy": 100 * t["course"].gbps(nbytes) / ceilings["copy_gbps"],
                }
            )
    return rows


def run_hf_child(quick: bool, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hf.json")
        cmd = [sys.executable, "-m", "kernels.decoder.benchmark_hf", path]
        cmd += ["--quick"] if quick else []
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
            status = f"exit {proc.returncode}" + (
                f": {proc.stderr[-2000:]}" if proc.returncode else ""
            )
        except subprocess.TimeoutExpired:
            status = f"stopped after {timeout_s:.0f} s"
        result = json.load(open(path)) if os.path.exists(path) else {"errors": {}}
        result["status"] = status
        return result


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    args = sys.argv[1:]
    quick = "--quick" in args
    only_pdl = "--pdl" in args
    if only_pdl:
        name, max_batch = "07_decoder_pdl", max(b for b, _ in PDL_DECODE)
    elif quick:
        name, max_batch = "07_decoder_quick", 1
    else:
        name, max_batch = "07_decoder", MEMORY[0]
    t_start = time.perf_counter()
    ceilings = bench.ceilings()
    hf = hf_reference.random_llama(CONFIG, seed=0, dtype=DTYPE, device=DEVICE)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=max_batch, max_seq=MAX_SEQ)
    del hf  # the decoder keeps what it shares (the embedding, the norms); the child builds its own
    model.cache.k.normal_()
    model.cache.v.normal_()
    results = {
        "fingerprint": runtime.fingerprint(),
        "ceilings": ceilings,
        "config": {
            **CONFIG.__dict__,
            "dtype": str(DTYPE),
            "parameters": CONFIG.n_parameters(),
            "max_seq": MAX_SEQ,
        },
        "steps per loop": STEPS,
        "rounds": ROUNDS,
        "errors": {},
    }

    def section(key, fn):
        """Run one part; a failure is recorded and the run goes on; results saved after each."""
        try:
            results[key] = fn()
            value = results[key]
            if isinstance(value, list) and value and isinstance(value[0], dict):
                print(bench.table(value, list(value[0]), floatfmt=".4g"), flush=True)
            else:
                print(key, value, flush=True)
        except Exception as exc:  # noqa: BLE001 - one failed part must not lose the others
            traceback.print_exc()
            results[key] = None
            results["errors"][key] = f"{type(exc).__name__}: {exc}"
        results["elapsed_s"] = time.perf_counter() - t_start
        bench.save_results(name, results)

    tokens = torch.randint(0, CONFIG.vocab_size, (1,), device=DEVICE)

    def eager_step():
        model.cache.length = 512
        model.decode_step(tokens)

    prompt = torch.randint(0, CONFIG.vocab_size, (1, 2048), device=DEVICE)
    configs = DECODE[:1] if quick else DECODE
    pdl_configs = [(b, c) for b, c in PDL_DECODE if (b, c) in configs]
    if only_pdl:  # the choice at PDL_DECODE's batches, then the PDL rows; nothing else
        section("decode_linears", lambda: choose_linears(model, [b for b, _ in PDL_DECODE]))
        section("decode_fused", lambda: choose_fused(model, [b for b, _ in PDL_DECODE]))
        section("decode_pdl", lambda: [decode_pdl(model, b, c, ceilings) for b, c in PDL_DECODE])
        print(f"wrote {name}.json in {results['elapsed_s']:.0f} s; errors: {results['errors']}")
        return 0
    # the graph first: a fault in an eager path (which launches many more kernels from Python)
    # cannot then cost the graph's numbers, and Hugging Face runs in a process of its own
    section("lab_kernels", lambda: lab_kernels(ceilings))
    # cuBLAS or the course GEMV for each projection, timed at the batches of the decode rows (the
    # model keeps the winners; a failure here leaves it on cuBLAS)
    section("decode_linears", lambda: choose_linears(model, [b for b, _ in configs]))
    # then which norms to fold into their GEMV, by timing the whole graph step (the cache is
    # still empty: the timing writes it)
    section("decode_fused", lambda: choose_fused(model, [b for b, _ in configs]))
    section("sweep", lambda: sweep(model, ceilings))
    section("decode", lambda: [decode_ours(model, b, c, ceilings) for b, c in configs])
    section("decode_pdl", lambda: [decode_pdl(model, b, c, ceilings) for b, c in pdl_configs])

    def graph_step():
        step = graph_for(model, 1)
        step.positions.fill_(512)
        step.replay()

    section(
        "profile_graph",
        lambda: kernel_breakdown(
            graph_step, f"decode b1 ctx 512 (graph, {linears_label(model, 1)})"
        ),
    )
    if not quick:
        section("memory", lambda: memory_ours(model, *MEMORY))
    section(
        "prefill",
        lambda: [
            prefill_ours(model, b, t, ceilings) for b, t in (PREFILL[:1] if quick else PREFILL)
        ],
    )
    section("eager", lambda: [decode_eager(model, b, c) for b, c in configs])
    section("host", lambda: host_breakdown(model))
    section(
        "profile",
        lambda: kernel_breakdown(
            eager_step, f"decode b1 ctx 512 (eager, {linears_label(model, 1)})"
        )
        + kernel_breakdown(lambda: model.prefill(prompt), "prefill 1x2048"),
    )
    section("hf", lambda: run_hf_child(quick, HF_TIMEOUT_S))
    hf = results.get("hf") or {}
    section(
        "decode", lambda: merge(merge(results["decode"], results.get("eager")), hf.get("decode"))
    )
    section("prefill", lambda: merge(results["prefill"], hf.get("prefill"), ("batch", "tokens")))
    if results.get("memory") and hf.get("memory"):
        results["memory"].update(hf["memory"])
    section(
        "targets",
        lambda: performance_targets(
            results.get("decode") or [], results.get("prefill") or [], results.get("memory")
        ),
    )
    for t in results["targets"] or []:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']}")
    print(
        f"wrote data/results/{runtime.gpu_info().slug}/{name}.json in "
        f"{results['elapsed_s']:.0f} s; errors: {results['errors'] or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
