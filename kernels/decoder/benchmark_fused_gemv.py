"""Benchmark of the fused GEMV (triton_fused_gemv.py): one decode layer's normed projections at
Llama-3.2-1B's shape, unfused (module 02's add + RMSNorm, the GEMV or cuBLAS, SwiGLU) against one
fused launch, the saving next to its prediction, and the whole step in a CUDA graph.

    python -m kernels.decoder.benchmark_fused_gemv
    (writes data/results/<gpu>/07_decoder_fused_gemv.json)
"""

from __future__ import annotations

import torch

from kernels import runtime
from kernels.decoder import triton_gemv
from kernels.decoder.config import BATCHES, LLAMA_1B, projection_shapes
from kernels.decoder.triton_fused_gemv import add_rms_norm_linear, check, tuned_kernel

# The GPU time of the launches folded away, from the H100 profile of the graph step
# (PERFORMANCE.md, section 3): module 02's fused add + RMSNorm 2.24 us a launch, SwiGLU 1.16 us,
# and 0.42 us of gap between two launches of the graph.
NORM_US, SWIGLU_US, GAP_US = 2.24, 1.16, 0.42
# What one fused launch replaces: the norm before the projection, and SwiGLU after gate_up.
LAUNCHES_REMOVED = {"qkv": 1, "gate_up": 2, "lm_head": 1}
SAVED_US = {
    "qkv": NORM_US + GAP_US,
    "gate_up": NORM_US + SWIGLU_US + 2 * GAP_US,
    "lm_head": NORM_US + GAP_US,
}


def time_against_unfused(
    batch: int, weight: torch.Tensor, *, swiglu: bool, linear, eps: float = 1e-5
) -> dict:
    """{"unfused", "fused"} bench.Timing of one normed projection at `batch` rows of random
    inputs: module 02's fused_add_rms_norm, `linear` (F.linear or triton_gemv.linear) and
    triton_ops.swiglu if `swiglu`, against add_rms_norm_linear. Each is captured in a CUDA graph,
    as the decode step runs it (no host launch in the time), and the two replays are interleaved
    with L2 flushed (kernels.bench). Both results are checked against float64 first."""
    from kernels import bench
    from kernels.decoder import triton_ops
    from kernels.rmsnorm import triton_rmsnorm
    from kernels.testing import random_tensor

    dtype, k = weight.dtype, weight.shape[1]
    delta, residual = (random_tensor((batch, k), dtype, weight.device) for _ in range(2))
    norm_weight = random_tensor((k,), dtype, weight.device)

    def unfused():
        y, r = triton_rmsnorm.fused_add_rms_norm(delta, residual, norm_weight, eps)
        out = linear(y, weight)
        return (triton_ops.swiglu(out) if swiglu else out), r

    def fused():
        return add_rms_norm_linear(delta, residual, norm_weight, weight, eps, swiglu=swiglu)

    for name, fn in (("unfused", unfused), ("fused", fused)):
        out, _ = fn()  # the first call autotunes: before the capture
        result = check(out, delta, residual, norm_weight, weight, eps, swiglu=swiglu)
        if not result.ok:
            raise AssertionError(f"{name}, batch {batch}, {tuple(weight.shape)}: {result.reason}")
    graphs = {"unfused": bench.capture_graph(unfused), "fused": bench.capture_graph(fused)}
    return bench.benchmark({name: g.replay for name, g in graphs.items()})


def benchmark_normed_projections(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Every normed projection of Llama-3.2-1B at each batch of BATCHES: unfused with cuBLAS and
    with the course GEMV, against the fused launch; the saving next to SAVED_US's prediction."""
    import torch.nn.functional as F

    from kernels import bench
    from kernels.testing import random_tensor

    shapes = projection_shapes(LLAMA_1B)
    rows = []
    for name in ("qkv", "gate_up", "lm_head"):
        n, k, per_step = shapes[name]
        weight = random_tensor((n, k), dtype, "cuda")
        for m in BATCHES:
            for linear_name, linear in (("cuBLAS", F.linear), ("GEMV", triton_gemv.linear)):
                t = time_against_unfused(m, weight, swiglu=name == "gate_up", linear=linear)
                unfused_us, fused_us = t["unfused"].median_us, t["fused"].median_us
                rows.append(
                    {
                        "projection": name,
                        "M": m,
                        "unfused linear": linear_name,
                        "per_step": per_step,
                        "unfused_us": unfused_us,
                        "fused_us": fused_us,
                        "saved_us": unfused_us - fused_us,
                        "predicted_saved_us": SAVED_US[name],
                        "speedup": bench.ratio(t["unfused"], t["fused"]),
                        "config": str(tuned_kernel.best_config),
                        "timings": {key: v.summary() for key, v in t.items()},
                    }
                )
                r = rows[-1]
                print(
                    f"{name:>8} M={m:<2} unfused ({linear_name:>6}) {unfused_us:7.2f} us  fused "
                    f"{fused_us:7.2f} us  saved {r['saved_us']:6.2f} us (predicted "
                    f"{SAVED_US[name]:.2f})  {r['speedup']:.3f}x  {r['config']}",
                    flush=True,
                )
    return rows


def per_step_saving(rows: list[dict]) -> list[dict]:
    """A decode step's saving per batch and unfused linear: each projection's saving times its
    launches a step (16 layers; lm_head once), against the prediction."""
    summary = []
    for m in BATCHES:
        for linear_name in ("cuBLAS", "GEMV"):
            mine = [r for r in rows if r["M"] == m and r["unfused linear"] == linear_name]
            summary.append(
                {
                    "M": m,
                    "unfused linear": linear_name,
                    "saved us": sum(r["per_step"] * r["saved_us"] for r in mine),
                    "predicted us": sum(r["per_step"] * r["predicted_saved_us"] for r in mine),
                    "launches removed": sum(
                        r["per_step"] * LAUNCHES_REMOVED[r["projection"]] for r in mine
                    ),
                }
            )
    return summary


def decode_step_comparison(batches=(1, 8), context: int = 512) -> list[dict]:
    """The whole decode step of Llama-3.2-1B (random bf16 weights) in a CUDA graph, with the
    linears Decoder.choose_decode_linears keeps, for every subset of the normed projections fused
    (Decoder.choose_decode_fused: the graphs replayed interleaved at the same context); the row
    names the fastest."""
    from kernels.decoder import hf_reference
    from kernels.decoder.model import Decoder, DecoderWeights

    hf = hf_reference.random_llama(LLAMA_1B, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=max(batches), max_seq=context + 64)
    del hf
    rows = []
    for batch in batches:
        model.choose_decode_linears(batch)
        step_us = model.choose_decode_fused(batch, context)
        apart = step_us["none"]
        rows.append(
            {
                "batch": batch,
                "context": context,
                "gemv kept for": sorted(model.decode_gemv[batch]),
                "fused kept for": sorted(model.decode_fused[batch]),
                **{f"{name} step ms": us / 1e3 for name, us in step_us.items()},
                **{f"{name} speedup": apart / us for name, us in step_us.items() if name != "none"},
            }
        )
        steps = ", ".join(f"{name} {us / 1e3:.3f} ms" for name, us in step_us.items())
        print(f"batch {batch}, fused: {steps}; kept {rows[-1]['fused kept for']}", flush=True)
    return rows


def main() -> int:
    from kernels import bench

    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    print(f"{runtime.gpu_info().name}: the normed projections of Llama-3.2-1B, bf16")
    rows = benchmark_normed_projections()
    summary = per_step_saving(rows)
    print("\nSaved per decode step (16 layers + lm_head), against the prediction:")
    print(bench.table(summary))
    results = {"fingerprint": runtime.fingerprint(), "projections": rows, "per_step": summary}
    bench.save_results("07_decoder_fused_gemv", results)  # kept if the slower part below fails
    print("\nThe decode step in a CUDA graph, context 512:")
    results["decode_step"] = decode_step_comparison()
    print(f"wrote {bench.save_results('07_decoder_fused_gemv', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
