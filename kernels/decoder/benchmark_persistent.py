"""Benchmark of the persistent decode step (triton_persistent_step.py) beside the CUDA-graph step
and the weight + KV floor, at Llama-3.2-1B's shape in bf16 with random weights.

    python -m kernels.decoder.benchmark_persistent [--batch 1] [--contexts 512,4096] [--trace]
    (adds its rows to data/results/<gpu>/07_decoder_megakernel.json)

The conventions are the decoder benchmark's: device time by events, the variants interleaved round
by round with L2 flushed before each, medians; the floor is every weight and the context's K and V
read once at the measured copy rate (benchmark.decode_floor_ms). Before timing, the persistent
step's logits are compared with the graph's on the same cache (their bf16 difference is printed
and saved) and its status word is checked (the watchdog). A few launch configurations of the
persistent step are timed (programs per SM, warps, K tile) and each is reported. `--trace` adds
one step of the first configuration at the first context with each program's clock at the begin
and end of each phase (the timeline of a step).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kernels import bench, runtime
from kernels.decoder import hf_reference, reference
from kernels.decoder import persistent_schedule as sched
from kernels.decoder.benchmark import decode_floor_ms
from kernels.decoder.config import LLAMA_1B, PROJECTIONS
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.decoder.triton_persistent_step import PersistentStep

NAME = "07_decoder_megakernel"
DTYPE = torch.bfloat16
MAX_SEQ = 4096 + 64
# (programs per SM, warps, K tile (0: the wrapper's default), stages): the launch configurations
# timed by default; --variants "1,8,0,1;2,4,1024,1" sets others
VARIANTS = ((1, 8, 0, 1), (2, 4, 0, 1))


def graph_steps(model: Decoder, batch: int) -> dict:
    """The CUDA-graph step twice: every projection on cuBLAS, and the course GEMV everywhere with
    the norms of qkv and gate_up folded in (the choice the decoder's benchmark measured at batch
    1 on the H200)."""
    model.set_decode_linears(batch, ())
    model.set_decode_fused(batch, ())
    cublas = model.capture_decode_graph(batch)
    model.set_decode_linears(batch, PROJECTIONS)
    model.set_decode_fused(batch, ("qkv", "gate_up"))
    return {"graph (cuBLAS)": cublas, "graph (GEMV, fused)": model.capture_decode_graph(batch)}


def measure(model: Decoder, batch: int, contexts, ceilings: dict, variants) -> list[dict]:
    sms = runtime.features().sm_count
    graphs = graph_steps(model, batch)
    persistent = {}
    for per_sm, warps, block_k, stages in variants:
        step = PersistentStep(
            model,
            batch,
            programs=per_sm * sms,
            num_warps=warps,
            block_k=block_k or None,
            num_stages=stages,
        )
        name = f"persistent ({per_sm}/SM, {warps} warps, K {step.block_k}, {stages} stages)"
        persistent[name] = step
    rows = []
    for context in contexts:
        tokens = torch.randint(0, LLAMA_1B.vocab_size, (batch,), device="cuda")
        steps = graphs | persistent
        # the same step on the same cache: logits against the graph's
        graph = graphs["graph (GEMV, fused)"]
        graph.start(tokens, context)
        graph.replay()
        want = graph.logits.clone()
        errors = {}
        for name, step in persistent.items():
            step.start(tokens, context)
            t0 = time.perf_counter()
            step.replay()
            step.check()
            errors[name] = reference.logits_error(step.logits, want)
            print(
                f"{name}: first launch {time.perf_counter() - t0:.1f} s, logits vs graph "
                f"{errors[name]:.4f}",
                flush=True,
            )

        def restart(steps=steps, context=context):
            for step in steps.values():
                step.positions.fill_(context)

        times = bench.benchmark(
            {name: step.replay for name, step in steps.items()},
            reps=20,
            flush=True,
            before_round=restart,
        )
        for step in persistent.values():
            step.check()
        floor = decode_floor_ms(batch, context, ceilings)
        for name, t in times.items():
            ms = t.median_us / 1e3
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "step": name,
                    "GPU ms": ms,
                    "floor ms": floor,
                    "% of floor": 100 * floor / ms,
                    "logits error vs graph": errors.get(name),
                }
            )
            print(
                f"batch {batch} ctx {context} {name}: {ms:.3f} ms, "
                f"{100 * floor / ms:.1f}% of the {floor:.3f} ms floor",
                flush=True,
            )
    return rows


def trace_step(model: Decoder, batch: int, context: int, variant) -> dict:
    """One step of the first variant with the clock stamps on (a build of its own): each
    program's begin and end of each phase, in microseconds from the first program's start."""
    per_sm, warps, block_k, stages = variant
    step = PersistentStep(
        model,
        batch,
        programs=per_sm * runtime.features().sm_count,
        num_warps=warps,
        block_k=block_k or None,
        num_stages=stages,
        trace=True,
    )
    tokens = torch.randint(0, LLAMA_1B.vocab_size, (batch,), device="cuda")
    for _ in range(3):  # the last of three, L2 flushed before it
        step.start(tokens, context)
        bench.flush_l2()
        step.replay()
    step.check()
    clock = step.trace.double()
    clock = (clock - clock[:, 0, 0].min()) / 1e3
    phases = sched.schedule(model.c, batch, step.programs)
    return {
        "batch": batch,
        "context": context,
        "programs": step.programs,
        "phases": [f"{p.name} {p.layer}" if p.layer is not None else p.name for p in phases],
        "us (program, phase, begin/end)": [
            [[round(v, 3) for v in pair] for pair in program] for program in clock.tolist()
        ],
    }


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    args = sys.argv[1:]
    batch = int(args[args.index("--batch") + 1]) if "--batch" in args else 1
    contexts = (512, 4096)
    if "--contexts" in args:
        contexts = tuple(int(c) for c in args[args.index("--contexts") + 1].split(","))
    variants = VARIANTS
    if "--variants" in args:
        spec = args[args.index("--variants") + 1]
        variants = [tuple(int(v) for v in part.split(",")) for part in spec.split(";")]
    ceilings = bench.ceilings()
    hf = hf_reference.random_llama(LLAMA_1B, seed=0, dtype=DTYPE, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=batch, max_seq=MAX_SEQ)
    del hf
    model.cache.k.normal_()
    model.cache.v.normal_()
    rows = measure(model, batch, contexts, ceilings, variants)
    traces = [trace_step(model, batch, contexts[0], variants[0])] if "--trace" in args else []
    path = bench.RESULTS_DIR / runtime.gpu_info().slug / f"{NAME}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    keep = [
        r
        for r in old.get("decode", [])
        if (r["batch"], r["context"]) not in {(r2["batch"], r2["context"]) for r2 in rows}
    ]
    results = {
        "fingerprint": runtime.fingerprint(),
        "ceilings": ceilings,
        "model": {**LLAMA_1B.__dict__, "dtype": str(DTYPE)},
        "decode": keep + rows,
        "traces": [
            t for t in old.get("traces", []) if (t["batch"], t["context"]) != (batch, contexts[0])
        ]
        + traces,
    }
    print("wrote", bench.save_results(NAME, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
