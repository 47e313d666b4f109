"""The decoder at Llama-3.2-1B's shape (bf16, random weights) against Hugging Face, all in one run.

Run on a GPU: `python -m kernels.decoder.benchmark` writes data/results/<gpu>/07_decoder.json (with
the environment fingerprint) and prints the targets; `--quick` measures batch 1 at context 512 only.

Decode, per token, wall time of a loop of steps synchronized at its end (what generation costs), the
implementations interleaved round by round:
* ours (graph): the decode step replayed from one CUDA graph (positions in device memory);
* ours (eager): the same step launched from Python (prefill/decode attention from module 03);
* HF eager: LlamaForCausalLM with a DynamicCache, one forward per token (+ argmax);
* HF static compiled: a StaticCache and the forward compiled as `generate` compiles it
  (`get_compiled_call`: torch.compile mode "reduce-overhead"), compile time recorded;
and the floor: weights + the KV cache read once, at the measured copy bandwidth. Prefill: ours and
HF
eager (SDPA), device events, against the GEMM floor (flops at the measured bf16 matmul rate). Then
the
eager step's host time split by wrapper, the per-kernel GPU time of a decode step and of a prefill
(torch.profiler), and the peak memory of batch 32 at a 4096-token context, ours beside HF's static
cache.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from kernels import bench, runtime
from kernels.decoder import hf_reference, triton_attention, triton_ops, triton_rope
from kernels.decoder.model import LLAMA_1B, Decoder, DecoderWeights
from kernels.flash_attention import triton_decode, triton_flash
from kernels.rmsnorm import triton_rmsnorm

CONFIG = LLAMA_1B
DTYPE = torch.bfloat16
DECODE = ((1, 512), (1, 4096), (8, 512), (32, 512))  # (batch, context)
PREFILL = ((1, 2048), (8, 512))
MEMORY = (32, 4096)
STEPS = 16  # decode steps per timed loop
ROUNDS = 5
COMPILE_BUDGET_S = 150  # HF static-cache compiles beyond this are skipped (and the row says so)
MAX_SEQ = 4096 + 2 * STEPS + 16
SWEEP_CONTEXTS = (128, 512, 1024, 2048, 4096)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)
DEVICE = runtime.DEVICE  # "cuda"; the CPU runs pieces of this file on a tiny model in tests
_compile_spent_s = [0.0]


def _sync() -> None:
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


def wall_per_call_ms(fns: dict, before: dict, calls: int = STEPS, rounds: int = ROUNDS) -> dict:
    """Median over rounds of (wall time of `calls` back-to-back calls, synchronized at the end) /
    calls; the functions interleaved round by round, `before[name]()` run untimed ahead of each."""
    times = defaultdict(list)
    for name, fn in fns.items():  # warm-up
        before[name]()
        fn()
    for r in range(rounds):
        for name, fn in fns.items():
            before[name]()
            _sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync()
            times[name].append((time.perf_counter() - t0) * 1e3 / calls)
    return {name: statistics.median(t) for name, t in times.items()}


class HFSteps:
    """Hugging Face's decode steps at a fixed context: eager with a DynamicCache, and compiled with
    a
    StaticCache (as `generate(cache_implementation="static")` does)."""

    def __init__(self, hf, batch: int, context: int, compiled: bool):
        from transformers import DynamicCache, StaticCache

        self.hf, self.batch, self.context = hf, batch, context
        prompt = torch.randint(0, CONFIG.vocab_size, (batch, context), device=DEVICE)
        self.token = torch.randint(0, CONFIG.vocab_size, (batch, 1), device=DEVICE)
        with torch.no_grad():
            self.dynamic = DynamicCache(config=hf.config)
            hf(input_ids=prompt, past_key_values=self.dynamic, use_cache=True, logits_to_keep=1)
        self.compile_s = None
        if compiled:
            from transformers import CompileConfig

            self.static = StaticCache(config=hf.config, max_cache_len=context + 2 * STEPS)
            with torch.no_grad():
                hf(
                    input_ids=prompt,
                    past_key_values=self.static,
                    use_cache=True,
                    logits_to_keep=1,
                    cache_position=torch.arange(context, device=DEVICE),
                )
            self.position = torch.full((1,), context, dtype=torch.int64, device=DEVICE)
            self.compiled = hf.get_compiled_call(CompileConfig())
            t0 = time.perf_counter()
            for _ in range(3):  # compile, then the CUDA-graph recordings of reduce-overhead
                self.static_step()
                self.reset_static()
            _sync()
            self.compile_s = time.perf_counter() - t0

    @torch.no_grad()
    def eager_step(self):
        logits = self.hf(
            input_ids=self.token, past_key_values=self.dynamic, use_cache=True, logits_to_keep=1
        ).logits
        return torch.argmax(logits[:, -1], -1)

    def reset_dynamic(self):
        extra = self.dynamic.get_seq_length() - self.context
        if extra:
            self.dynamic.crop(-extra)

    @torch.no_grad()
    def static_step(self):
        logits = self.compiled(
            input_ids=self.token,
            past_key_values=self.static,
            use_cache=True,
            logits_to_keep=1,
            cache_position=self.position,
            position_ids=self.position.view(1, 1).expand(self.batch, 1),
        ).logits
        self.position += 1
        return torch.argmax(logits[:, -1], -1)

    def reset_static(self):
        self.position.fill_(self.context)


def decode_row(hf, model: Decoder, batch: int, context: int, ceilings: dict) -> dict:
    step = (
        model._graph
        if model._graph is not None and model._graph.batch == batch
        else model.capture_decode_graph(batch)
    )
    tokens = torch.randint(0, CONFIG.vocab_size, (batch,), device=DEVICE)
    step.start(tokens, context)

    def reset_eager():
        model.cache.length = context

    compiled = runtime.ON_GPU and _compile_spent_s[0] < COMPILE_BUDGET_S
    hf_steps = HFSteps(hf, batch, context, compiled)
    _compile_spent_s[0] += hf_steps.compile_s or 0.0
    fns = {
        "ours (graph)": step.replay,
        "ours (eager)": lambda: model.decode_step(tokens),
        "HF eager": hf_steps.eager_step,
    }
    before = {
        "ours (graph)": lambda: step.positions.fill_(context),
        "ours (eager)": reset_eager,
        "HF eager": hf_steps.reset_dynamic,
    }
    if compiled:
        fns["HF static compiled"] = hf_steps.static_step
        before["HF static compiled"] = hf_steps.reset_static
    ms = wall_per_call_ms(fns, before)
    gpu = bench.benchmark(
        {"graph": step.replay},
        reps=20,
        flush=False,
        before_round=lambda: step.positions.fill_(context),
    )["graph"]
    nbytes = decode_bytes(batch, context)
    floor_ms = nbytes / (ceilings["copy_gbps"] * 1e9) * 1e3
    row = {
        "batch": batch,
        "context": context,
        "bytes": nbytes,
        "floor ms": floor_ms,
        **{f"{k} ms": v for k, v in ms.items()},
        "ours (graph) GPU ms": gpu.median_us / 1e3,
        "ours % of floor": 100 * floor_ms / ms["ours (graph)"],
        "tokens/s (graph)": batch / ms["ours (graph)"] * 1e3,
        "HF static compile s": hf_steps.compile_s,
    }
    for k in ("HF eager", "HF static compiled"):
        if k in ms:
            row[f"ours vs {k}"] = ms[k] / ms["ours (graph)"]
    if not compiled:
        row["HF static compiled"] = "not measured: the run's compile budget was spent"
    model.cache.length = 0
    return row


def prefill_row(hf, model: Decoder, batch: int, tokens: int, ceilings: dict) -> dict:
    prompt = torch.randint(0, CONFIG.vocab_size, (batch, tokens), device=DEVICE)

    @torch.no_grad()
    def hf_prefill():
        return hf(input_ids=prompt, use_cache=True, logits_to_keep=1).logits

    t = bench.benchmark({"ours": lambda: model.prefill(prompt), "HF eager": hf_prefill}, reps=10)
    flops = prefill_flops(batch, tokens)
    floor_ms = flops / (ceilings["matmul_bf16_tflops"] * 1e12) * 1e3
    ours, theirs = t["ours"].median_us / 1e3, t["HF eager"].median_us / 1e3
    return {
        "batch": batch,
        "tokens": tokens,
        "flops": flops,
        "floor ms": floor_ms,
        "ours ms": ours,
        "HF eager ms": theirs,
        "ours vs HF eager": theirs / ours,
        "ours % of floor": 100 * floor_ms / ours,
        "ours TFLOP/s": flops / ours / 1e9,
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
    "F.linear (cuBLAS)": (F, "linear"),
}


def host_breakdown(model: Decoder, batch: int = 1, context: int = 512, steps: int = 50) -> dict:
    """Host time of the eager decode step (no synchronization inside), and each wrapper's share:
    every wrapper the step calls is timed from call to return (for an asynchronous launch, that is
    its host cost)."""
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
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.cache.length = context
        triton_ops.argmax(model.decode_step(tokens))
    host_us = (time.perf_counter() - t0) / steps * 1e6  # the GPU keeps up: this is the host's time
    _sync()
    for name, (module, attr) in WRAPPERS.items():
        originals[name] = getattr(module, attr)
        setattr(module, attr, timed(name, originals[name]))
    try:
        for _ in range(steps):
            model.cache.length = context
            triton_ops.argmax(model.decode_step(tokens))
        _sync()
    finally:
        for name, (module, attr) in WRAPPERS.items():
            setattr(module, attr, originals[name])
    model.cache.length = 0
    per_step = {k: v / steps * 1e6 for k, v in spent.items()}
    return {
        "batch": batch,
        "context": context,
        "eager step host us": host_us,
        "wrappers us per step": per_step,
        "calls per step": {k: v // steps for k, v in calls.items()},
        "course wrappers share": sum(v for k, v in per_step.items() if "F.linear" not in k)
        / host_us,
    }


def kernel_breakdown(fn, label: str) -> list[dict]:
    """GPU time per kernel (summed over launches) of one call of `fn`, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count:
            rows.append({"what": label, "kernel": e.key[:90], "us": us, "launches": e.count})
    return sorted(rows, key=lambda r: -r["us"])


def memory_row(hf, model: Decoder, batch: int, context: int) -> dict:
    """Peak memory of a decode step at (batch, context): weights + cache + the step's transient
    peak, for ours (graph replay) and HF's static cache (eager forward, the cache it compiles)."""
    from transformers import StaticCache

    def footprint(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    w = model.w
    ours_weights = footprint(
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
    step = (
        model._graph
        if model._graph is not None and model._graph.batch == batch
        else model.capture_decode_graph(batch)
    )
    step.start(torch.zeros(batch, dtype=torch.int64, device=DEVICE), context)
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step.replay()
    _sync()
    ours_transient = torch.cuda.max_memory_allocated() - base
    ours_cache = model.cache.nbytes()
    hf_weights = footprint(list(hf.parameters()))
    cache = StaticCache(config=hf.config, max_cache_len=context + 64)
    token = torch.zeros(batch, 1, dtype=torch.int64, device=DEVICE)
    with torch.no_grad():
        hf(
            input_ids=token,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        )
        _sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        pos = torch.full((1,), context, dtype=torch.int64, device=DEVICE)
        hf(
            input_ids=token,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=pos,
        )
        _sync()
    hf_transient = torch.cuda.max_memory_allocated() - base
    hf_cache = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    gib = 2**30
    return {
        "batch": batch,
        "context": context,
        "ours weights GiB": ours_weights / gib,
        "ours cache GiB": ours_cache / gib,
        "ours step transient GiB": ours_transient / gib,
        "ours total GiB": (ours_weights + ours_cache + ours_transient) / gib,
        "HF weights GiB": hf_weights / gib,
        "HF static cache GiB": hf_cache / gib,
        "HF step transient GiB": hf_transient / gib,
        "HF total GiB": (hf_weights + hf_cache + hf_transient) / gib,
    }


def performance_targets(decode: list[dict], prefill: list[dict], memory: dict | None) -> list[dict]:
    targets = []
    for r in decode:
        hf_c = r.get("HF static compiled ms")
        if r["batch"] == 1:
            targets.append(
                {
                    "target": f"decode b1 ctx {r['context']}: >= 85% of floor",
                    "value": f"{r['ours % of floor']:.1f}%",
                    "met": r["ours % of floor"] >= 85,
                }
            )
        targets.append(
            {
                "target": f"decode b{r['batch']} ctx {r['context']}: faster than HF static "
                "compiled",
                "value": f"{hf_c / r['ours (graph) ms']:.2f}x" if hf_c else "not measured",
                "met": bool(hf_c and hf_c > r["ours (graph) ms"]),
            }
        )
    for r in prefill:
        targets.append(
            {
                "target": f"prefill {r['batch']}x{r['tokens']}: >= 1.1x HF eager",
                "value": f"{r['ours vs HF eager']:.2f}x",
                "met": r["ours vs HF eager"] >= 1.1,
            }
        )
    if memory:
        targets.append(
            {
                "target": "peak memory b32 x 4096 <= HF static cache",
                "value": f"{memory['ours total GiB']:.2f} vs {memory['HF total GiB']:.2f} GiB",
                "met": memory["ours total GiB"] <= memory["HF total GiB"],
            }
        )
    return targets


def sweep(model: Decoder, ceilings: dict) -> list[dict]:
    """GPU time of the graph's decode step (device events) across contexts at batch 1 and across
    batches at context 512, beside the floor: the data of the tokens/s plots."""
    rows = []
    points = [(1, c) for c in SWEEP_CONTEXTS] + [(b, 512) for b in SWEEP_BATCHES if b > 1]
    for batch, context in points:
        if batch > model.max_batch:
            continue
        step = model._graph if model._graph is not None and model._graph.batch == batch else \
            model.capture_decode_graph(batch)
        step.start(torch.zeros(batch, dtype=torch.int64, device=DEVICE), context)
        t = bench.benchmark({"graph": step.replay}, reps=20, flush=False,
                            before_round=lambda: step.positions.fill_(context))["graph"]
        floor_ms = decode_bytes(batch, context) / (ceilings["copy_gbps"] * 1e9) * 1e3
        ms = t.median_us / 1e3
        rows.append({"batch": batch, "context": context, "graph GPU ms": ms, "floor ms": floor_ms,
                     "% of floor": 100 * floor_ms / ms, "tokens/s": batch / ms * 1e3})
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
            t = bench.benchmark({"course": lambda: spec.course_kernel(*inputs, out=out),
                                 "torch": lambda: spec.torch_native(*inputs)})
            nbytes = spec.bytes_moved(*inputs)
            rows.append({"function": spec.name, "config": perf.id,
                         "reference_us": t["course"].median_us, "torch_us": t["torch"].median_us,
                         "reference_gbps": t["course"].gbps(nbytes),
                         "% of copy": 100 * t["course"].gbps(nbytes) / ceilings["copy_gbps"]})
    return rows


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    quick = "--quick" in sys.argv[1:]
    name = "07_decoder_quick" if quick else "07_decoder"
    t_start = time.perf_counter()
    ceilings = bench.ceilings()
    hf = hf_reference.random_llama(CONFIG, seed=0, dtype=DTYPE, device=DEVICE)
    max_batch = 1 if quick else MEMORY[0]
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=max_batch, max_seq=MAX_SEQ)
    model.cache.k.normal_()
    model.cache.v.normal_()
    results = {"fingerprint": runtime.fingerprint(), "ceilings": ceilings,
               "config": {**CONFIG.__dict__, "dtype": str(DTYPE),
                          "parameters": CONFIG.n_parameters(), "max_seq": MAX_SEQ},
               "steps per loop": STEPS, "rounds": ROUNDS, "errors": {}}

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
            import traceback

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
    section("lab_kernels", lambda: lab_kernels(ceilings))
    section("sweep", lambda: sweep(model, ceilings))
    section("decode", lambda: [decode_row(hf, model, b, c, ceilings)
                               for b, c in (DECODE[:1] if quick else DECODE)])
    section("prefill", lambda: [prefill_row(hf, model, b, t, ceilings)
                                for b, t in (PREFILL[:1] if quick else PREFILL)])
    section("host", lambda: host_breakdown(model))
    section("profile", lambda: kernel_breakdown(eager_step, "decode b1 ctx 512 (eager)")
            + kernel_breakdown(lambda: model.prefill(prompt), "prefill 1x2048"))
    model.reset()
    if not quick:
        section("memory", lambda: memory_row(hf, model, *MEMORY))
    section("targets", lambda: performance_targets(results.get("decode") or [],
                                                   results.get("prefill") or [],
                                                   results.get("memory")))
    for t in results["targets"] or []:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']}")
    print(f"wrote data/results/{runtime.gpu_info().slug}/{name}.json in "
          f"{results['elapsed_s']:.0f} s; errors: {results['errors'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
