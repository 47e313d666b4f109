"""Benchmark of the decode GEMV (triton_gemv.py): each projection of Llama-3.2-1B against cuBLAS
(F.linear) at the decode batches, the GEMM time of one step, and the whole step in a CUDA graph with
the GEMV kept where it measured faster.

    python -m kernels.decoder.benchmark_gemv     -> data/results/<gpu>/07_decoder_gemv.json
"""

from __future__ import annotations

import torch

from kernels import runtime
from kernels.decoder.config import BATCHES, LLAMA_1B, projection_shapes
from kernels.decoder.triton_gemv import check, linear, tuned_kernel


def benchmark_projections(dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    import torch.nn.functional as F

    from kernels import bench
    from kernels.testing import random_tensor

    copy_gbps = bench.ceilings()["copy_gbps"]
    rows = []
    for name, (n, k, per_step) in projection_shapes(LLAMA_1B).items():
        w = random_tensor((n, k), dtype, "cuda")
        for m in BATCHES:
            x = random_tensor((m, k), dtype, "cuda")
            result = check(linear(x, w), x, w)  # the first call autotunes this shape
            config = str(tuned_kernel.best_config)
            if not result.ok:
                raise AssertionError(f"{name} M={m}: {result.reason}")
            t = bench.benchmark({"F.linear": lambda: F.linear(x, w), "ours": lambda: linear(x, w)})
            nbytes = (n * k + m * k + m * n) * dtype.itemsize
            rows.append(
                {
                    "projection": name,
                    "M": m,
                    "N": n,
                    "K": k,
                    "per_step": per_step,
                    "MB": nbytes / 1e6,
                    "cublas_us": t["F.linear"].median_us,
                    "ours_us": t["ours"].median_us,
                    "cublas_pct_copy": 100 * t["F.linear"].gbps(nbytes) / copy_gbps,
                    "ours_GBps": t["ours"].gbps(nbytes),
                    "ours_pct_copy": 100 * t["ours"].gbps(nbytes) / copy_gbps,
                    "speedup": bench.ratio(t["F.linear"], t["ours"]),
                    "config": config,
                    "timings": {key: v.summary() for key, v in t.items()},
                }
            )
            r = rows[-1]
            print(
                f"{name:>8} M={m:<2} {r['MB']:7.1f} MB  cuBLAS {r['cublas_us']:7.1f} us "
                f"({r['cublas_pct_copy']:4.1f}% of copy)  ours {r['ours_us']:7.1f} us "
                f"({r['ours_pct_copy']:4.1f}%)  {r['speedup']:.2f}x  {config}",
                flush=True,
            )
    return rows


def per_step_summary(rows: list[dict]) -> list[dict]:
    """A decode step's GEMM time per batch: all cuBLAS, all ours, and the faster of the two per
    projection (what Decoder.choose_decode_linears keeps)."""
    summary = []
    for m in BATCHES:
        mine = [r for r in rows if r["M"] == m]
        cublas = sum(r["per_step"] * r["cublas_us"] for r in mine)
        ours = sum(r["per_step"] * r["ours_us"] for r in mine)
        best = sum(r["per_step"] * min(r["cublas_us"], r["ours_us"]) for r in mine)
        summary.append({"M": m, "cuBLAS us": cublas, "ours us": ours, "faster of each us": best})
    return summary


def decode_step_comparison(batches=(1, 8), context: int = 512) -> list[dict]:
    """The whole decode step of Llama-3.2-1B (random bf16 weights) in a CUDA graph: every projection
    on cuBLAS against the GEMV kept where Decoder.choose_decode_linears measured it faster, the two
    graphs replayed interleaved (device events) at the same context."""
    from kernels import bench
    from kernels.decoder import hf_reference
    from kernels.decoder.model import DecodeGraph, Decoder, DecoderWeights

    hf = hf_reference.random_llama(LLAMA_1B, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=max(batches), max_seq=context + 64)
    del hf
    rows = []
    for batch in batches:
        tokens = torch.randint(0, LLAMA_1B.vocab_size, (batch,), device="cuda")
        model.set_decode_linears(batch, ())
        graphs = {"cuBLAS": DecodeGraph(model, batch)}
        measured = model.choose_decode_linears(batch)
        graphs["chosen"] = DecodeGraph(model, batch)

        def restart(graphs=graphs, tokens=tokens):
            for g in graphs.values():
                g.start(tokens, context)

        t = bench.benchmark({k: g.replay for k, g in graphs.items()}, before_round=restart)
        rows.append(
            {
                "batch": batch,
                "context": context,
                "gemv kept for": sorted(model.decode_gemv[batch]),
                "cuBLAS step ms": t["cuBLAS"].median_us / 1e3,
                "chosen step ms": t["chosen"].median_us / 1e3,
                "speedup": bench.ratio(t["cuBLAS"], t["chosen"]),
                "choice": measured,
            }
        )
        print(
            f"batch {batch}: step {rows[-1]['cuBLAS step ms']:.3f} ms on cuBLAS, "
            f"{rows[-1]['chosen step ms']:.3f} ms with the GEMV for {rows[-1]['gemv kept for']} "
            f"({rows[-1]['speedup']:.3f}x)",
            flush=True,
        )
    return rows


def main() -> int:
    from kernels import bench

    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    ceilings = bench.ceilings()
    print(f"{runtime.gpu_info().name}: copy {ceilings['copy_gbps']:.0f} GB/s")
    rows = benchmark_projections()
    summary = per_step_summary(rows)
    print("\nGEMM time of one decode step (16 layers + lm_head, kernels back to back):")
    print(bench.table(summary))
    results = {
        "fingerprint": runtime.fingerprint(),
        "ceilings": {k: v for k, v in ceilings.items() if k != "fingerprint"},
        "projections": rows,
        "per_step": summary,
    }
    bench.save_results("07_decoder_gemv", results)  # kept if the slower part below fails
    print("\nThe decode step in a CUDA graph, context 512:")
    results["decode_step"] = decode_step_comparison()
    print(f"wrote {bench.save_results('07_decoder_gemv', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
