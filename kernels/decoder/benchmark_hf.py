"""The decoder benchmark's Hugging Face side: LlamaForCausalLM at the same shape, random weights and
configurations as ours (benchmark.py), eager with a DynamicCache, and a StaticCache with the forward
compiled as `generate` compiles it (`get_compiled_call`: torch.compile mode "reduce-overhead";
compile time recorded, later compiles skipped past COMPILE_BUDGET_S), its prefill (eager, SDPA) and
its peak memory with a static cache, timed as ours are (benchmark.wall_per_call_ms,
benchmark.prefill_times).

benchmark.py runs it in a process of its own (a fault here cannot touch our numbers, and
torch.compile's CUDA-graph pools stay out of ours) and merges its rows into 07_decoder.json:

    python -m kernels.decoder.benchmark_hf PATH [--quick]   -> PATH: decode, prefill, memory, errors
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from kernels import bench, runtime
from kernels.decoder import benchmark, hf_reference

COMPILE_BUDGET_S = 150  # HF static-cache compiles beyond this are skipped (and the row says so)


def set_static_length(cache, length: int) -> None:
    """Move a transformers StaticCache's write position to `length`, in place (the compiled step's
    CUDA graphs hold these tensors' addresses). A static layer of transformers 5 appends at its own
    counter (`cumulative_length`, a tensor it advances by every call) and takes no cache_position:
    rewinding only the positions we pass would let every step of every timed round append past the
    last one, off the end of the cache (on a GPU, a device-side assert in index_copy_)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


class HFSteps:
    """Hugging Face's decode steps at a fixed context: eager with a DynamicCache, and compiled with
    a StaticCache (as `generate(cache_implementation="static")` does). Each reset takes a cache back
    to `context` tokens, so a round of at most 2 * STEPS steps stays inside the static cache."""

    def __init__(self, hf, batch: int, context: int, compiled: bool):
        from transformers import DynamicCache, StaticCache

        self.hf, self.batch, self.context = hf, batch, context
        prompt = torch.randint(
            0, benchmark.CONFIG.vocab_size, (batch, context), device=benchmark.DEVICE
        )
        self.token = torch.randint(
            0, benchmark.CONFIG.vocab_size, (batch, 1), device=benchmark.DEVICE
        )
        with torch.no_grad():
            self.dynamic = DynamicCache(config=hf.config)
            hf(input_ids=prompt, past_key_values=self.dynamic, use_cache=True, logits_to_keep=1)
        self.compile_s = None
        if compiled:
            from transformers import CompileConfig

            self.static = StaticCache(config=hf.config, max_cache_len=context + 2 * benchmark.STEPS)
            with torch.no_grad():
                hf(
                    input_ids=prompt,
                    past_key_values=self.static,
                    use_cache=True,
                    logits_to_keep=1,
                )
            self.position = torch.full((1,), context, dtype=torch.int64, device=benchmark.DEVICE)
            self.compiled = hf.get_compiled_call(CompileConfig())
            t0 = time.perf_counter()
            for _ in range(3):  # compile, then the CUDA-graph recordings of reduce-overhead
                self.static_step()
                self.reset_static()
            benchmark.sync()
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
            position_ids=self.position.view(1, 1).expand(self.batch, 1),
        ).logits
        self.position += 1
        return torch.argmax(logits[:, -1], -1)

    def reset_static(self):
        self.position.fill_(self.context)
        set_static_length(self.static, self.context)


def decode_hf(hf, batch: int, context: int, spent: list) -> dict:
    """HF eager and (within the compile budget) HF static compiled, per token; `spent` carries the
    compile seconds used so far."""
    compiled = spent[0] < COMPILE_BUDGET_S
    steps = HFSteps(hf, batch, context, compiled)
    spent[0] += steps.compile_s or 0.0
    fns, before = {"HF eager": steps.eager_step}, {"HF eager": steps.reset_dynamic}
    if compiled:
        fns["HF static compiled"] = steps.static_step
        before["HF static compiled"] = steps.reset_static
    row = {
        "batch": batch,
        "context": context,
        "HF static compile s": steps.compile_s,
        **{f"{k} ms": v for k, v in benchmark.wall_per_call_ms(fns, before).items()},
    }
    if not compiled:
        row["HF static compiled"] = "not measured: the run's compile budget was spent"
    return row


def prefill_hf(hf, batch: int, tokens: int) -> dict:
    prompt = torch.randint(0, benchmark.CONFIG.vocab_size, (batch, tokens), device=benchmark.DEVICE)

    @torch.no_grad()
    def hf_prefill():
        return hf(input_ids=prompt, use_cache=True, logits_to_keep=1).logits

    ms, gpu_ms = benchmark.prefill_times(hf_prefill)
    return {"batch": batch, "tokens": tokens, "HF eager ms": ms, "HF eager GPU ms": gpu_ms}


def memory_hf(hf, batch: int, context: int) -> dict:
    """Weights + static cache + the transient peak of one eager step with that cache (the cache
    `generate(cache_implementation="static")` allocates for this context)."""
    from transformers import StaticCache

    weights = benchmark.footprint(list(hf.parameters()))
    cache = StaticCache(config=hf.config, max_cache_len=context + 2 * benchmark.STEPS + 16)
    token = torch.zeros(batch, 1, dtype=torch.int64, device=benchmark.DEVICE)
    with torch.no_grad():
        for position in (0, context):  # the first call allocates the cache's tensors
            set_static_length(cache, position)
            benchmark.sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            hf(
                input_ids=token,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                position_ids=torch.full(
                    (batch, 1), position, dtype=torch.int64, device=benchmark.DEVICE
                ),
            )
            benchmark.sync()
    transient = torch.cuda.max_memory_allocated() - base
    nbytes = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    gib = 2**30
    return {
        "HF weights GiB": weights / gib,
        "HF static cache GiB": nbytes / gib,
        "HF step transient GiB": transient / gib,
        "HF total GiB": (weights + nbytes + transient) / gib,
    }


def hf_child(path: str, quick: bool) -> int:
    """The Hugging Face half of the run, in its own process: rows written to `path` as JSON."""
    hf = hf_reference.random_llama(
        benchmark.CONFIG, seed=0, dtype=benchmark.DTYPE, device=benchmark.DEVICE
    )
    out, spent = {"errors": {}}, [0.0]
    parts = {
        "decode": lambda: [
            decode_hf(hf, b, c, spent)
            for b, c in (benchmark.DECODE[:1] if quick else benchmark.DECODE)
        ],
        "prefill": lambda: [
            prefill_hf(hf, b, t) for b, t in (benchmark.PREFILL[:1] if quick else benchmark.PREFILL)
        ],
        "memory": lambda: None if quick else memory_hf(hf, *benchmark.MEMORY),
    }
    for key, fn in parts.items():
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001 - record and go on with the next part
            # with where it was raised: a device-side assert names no op in its message
            where = "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
            out[key], out["errors"][key] = None, f"{type(exc).__name__}: {exc}\n{where}"
        print(f"HF {key}: {out[key]}", flush=True)
        with open(path, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        sys.exit(1)
    sys.exit(hf_child(sys.argv[1], "--quick" in sys.argv[2:]))
