"""Benchmark of the persistent decode step (triton_persistent_step.py) beside the CUDA-graph step
and the weight + KV floor, at Llama-3.2-1B's shape in bf16 with random weights.

    python -m kernels.decoder.benchmark_persistent [--batch 1] [--contexts 512,4096] [--trace]
        [--variants "1,8,0,1;1,8,0,1,512,5;1,8,0,1,1024,3,1"] [--name 07_decoder_megakernel]
    (adds its rows to data/results/<gpu>/<name>.json)

The conventions are the decoder benchmark's: device time by events, the variants interleaved round
by round with L2 flushed before each, medians; the floor is every weight and the context's K and V
read once at the measured copy rate (benchmark.decode_floor_ms). Before timing, the persistent
step's logits are compared with the graph's on the same cache (their bf16 difference is printed
and saved) and its status word is checked (the watchdog). A few launch configurations of the
persistent step are timed (programs per SM, warps, K tile, stages, and the GEMV phases' K tile
pipelined through shared memory with its stages, whether their product is summed over K once
a unit instead of once a tile, and whether the qkv phase is pipelined too) and each is
reported. `--trace` adds one step of the first configuration at the first context with each
program's clock at the begin and end of each phase (the timeline of a step), and prints where
its time went (`trace_phases`: each phase kind's span against its own byte floor, and the waits
at the counters).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kernels import bench, runtime
from kernels.decoder import hf_reference, reference
from kernels.decoder import persistent_schedule as sched
from kernels.decoder.benchmark import decode_floor_ms
from kernels.decoder.config import LLAMA_1B, PROJECTIONS, projection_shapes
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.decoder.triton_persistent_step import PersistentStep

NAME = "07_decoder_megakernel"
DTYPE = torch.bfloat16
MAX_SEQ = 4096 + 64
# (programs per SM, warps, K tile (0: the wrapper's default), stages[, pipelined K tile (0: none),
# its stages[, 1: its product summed over K once a unit (defer_reduce)[, 1: the qkv phase
# pipelined too (pipelined_qkv)[, 1: the attention phase's products as tl.dot
# (attention_dot)]]]]): the launch configurations timed by default;
# --variants "1,8,0,1;1,8,0,1,512,5;1,8,0,1,1024,3,1,1,1" sets others
VARIANTS = ((1, 8, 0, 1), (2, 4, 0, 1))


def persistent_step(model: Decoder, batch: int, variant, trace: bool = False):
    """(its name, the PersistentStep) of one launch configuration."""
    pipelined = (0, 4, 0, 0, 0)  # no pipelined K tile; 4 stages when one is given without them
    per_sm, warps, block_k, stages, pipelined_k, pipeline_stages, defer_reduce, qkv, attn_dot = (
        *variant,
        *pipelined[len(variant) - 4 :],
    )
    step = PersistentStep(
        model,
        batch,
        programs=per_sm * runtime.features().sm_count,
        num_warps=warps,
        block_k=block_k or None,
        num_stages=stages,
        pipelined_k=pipelined_k,
        pipeline_stages=pipeline_stages,
        defer_reduce=bool(defer_reduce),
        pipelined_qkv=bool(qkv),
        attention_dot=bool(attn_dot),
        trace=trace,
    )
    name = f"persistent ({per_sm}/SM, {warps} warps, K {step.block_k}, {stages} stages"
    if pipelined_k:
        name += f", GEMV K {pipelined_k} pipelined x {pipeline_stages}"
    if defer_reduce:
        name += ", summed over K once a unit"
    if qkv:
        name += ", qkv pipelined"
    if attn_dot:
        name += ", attention on tensor cores"
    return name + ")", step


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
    graphs = graph_steps(model, batch)
    persistent = dict(persistent_step(model, batch, variant) for variant in variants)
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
    _, step = persistent_step(model, batch, variant, trace=True)
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


def phase_bytes(config, batch: int, context: int, itemsize: int) -> dict[str, int]:
    """The compulsory bytes of one phase of each kind: its weights read once (with the RMSNorm's
    weight where the phase applies one), attention's K and V of the context. Over the schedule
    they add up to the step's floor (benchmark.decode_bytes); combine and argmax read only what
    the step itself wrote, so their floor is 0."""
    c = config
    weights = {name: n * k for name, (n, k, _) in projection_shapes(c).items()}
    elements = {
        "qkv": weights["qkv"] + c.hidden_size,  # + the attention norm's weight
        "attention": 2 * batch * c.n_kv_heads * context * c.head_dim,
        "combine": 0,
        "o": weights["o"],
        "gate_up": weights["gate_up"] + c.hidden_size,  # + the MLP norm's weight
        "down": weights["down"],
        "lm_head": weights["lm_head"] + c.hidden_size,  # + the final norm's weight
        "argmax": 0,
    }
    return {name: n * itemsize for name, n in elements.items()}


def trace_phases(trace: dict, config, copy_gbps: float, itemsize: int) -> list[dict]:
    """Where the time of a traced step (trace_step's dict) went: one row per phase kind, then the
    counter boundaries, then the whole step. A phase's

    * `span us`: its first program's begin to its last program's end, the median over layers;
    * `floor us`: its bytes (phase_bytes) at `copy_gbps`, and `% of floor` = floor / span;
    * `wait us`: a program's end of the phase before to its begin of this one (its arrival, the
      spin on the counter, the acquire), the mean over programs, the median over layers;
    * `step us`, `step floor us`: the spans and the floors summed over the step.

    The `counters` row is the boundary between two phases: the last program's end of one to the
    first program's begin of the next (`span us` the median, `step us` the sum). Phases and
    boundaries tile the step, so their `step us` add up to the `step` row's; its `wait us` is a
    program's total wait over the step, the mean over programs."""
    clock = trace["us (program, phase, begin/end)"]  # [program][phase] = (begin, end)
    kinds = [name.split()[0] for name in trace["phases"]]
    first_begin = [min(program[i][0] for program in clock) for i in range(len(kinds))]
    last_end = [max(program[i][1] for program in clock) for i in range(len(kinds))]
    waits = [0.0] + [
        statistics.fmean(program[i][0] - program[i - 1][1] for program in clock)
        for i in range(1, len(kinds))
    ]
    nbytes = phase_bytes(config, trace["batch"], trace["context"], itemsize)
    rows = []
    for kind in dict.fromkeys(kinds):
        at = [i for i, k in enumerate(kinds) if k == kind]
        spans = [last_end[i] - first_begin[i] for i in at]
        span = statistics.median(spans)
        floor = nbytes[kind] / (copy_gbps * 1e3)  # bytes / (GB/s) in us
        later = [waits[i] for i in at if i > 0]  # the step's first phase waits for nothing
        rows.append(
            {
                "phase": kind,
                "times": len(at),
                "span us": span,
                "floor us": floor,
                "% of floor": 100 * floor / span if floor else None,
                "wait us": statistics.median(later) if later else 0.0,
                "step us": sum(spans),
                "step floor us": floor * len(at),
            }
        )
    gaps = [first_begin[i] - last_end[i - 1] for i in range(1, len(kinds))]
    rows.append(
        {
            "phase": "counters",
            "times": len(gaps),
            "span us": statistics.median(gaps),
            "floor us": 0.0,
            "% of floor": None,
            "wait us": None,
            "step us": sum(gaps),
            "step floor us": 0.0,
        }
    )
    step = last_end[-1] - first_begin[0]
    floor = sum(r["step floor us"] for r in rows)
    rows.append(
        {
            "phase": "step",
            "times": 1,
            "span us": step,
            "floor us": floor,
            "% of floor": 100 * floor / step,
            "wait us": sum(waits),
            "step us": step,
            "step floor us": floor,
        }
    )
    return rows


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
    for trace in traces:
        spent = trace_phases(trace, LLAMA_1B, ceilings["copy_gbps"], DTYPE.itemsize)
        print(bench.table(spent, floatfmt=".2f"))
    name = args[args.index("--name") + 1] if "--name" in args else NAME
    path = bench.RESULTS_DIR / runtime.gpu_info().slug / f"{name}.json"
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
    print("wrote", bench.save_results(name, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
