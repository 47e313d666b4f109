"""Benchmarks of the Triton attention kernels: the measurements behind notebook 03 and
data/results/<gpu>/, and the helpers the other attention benchmarks share.

    python -m kernels.flash_attention.benchmark     -> data/results/<gpu>/03_flash_attention.json

Prints the course's performance targets. A first run compiles about 110 Triton kernels while
autotuning (a second or two each, cached on disk afterwards): budget 4-6 minutes, or split it:
`python -m kernels.flash_attention.benchmark targets`, then `... sweep memory decode decode_splits`
(a run of some sections updates them in the existing JSON). The benchmarks with files of their own,
data/results/<gpu>/03_flash_attention_<name>.json, are modules of their own: benchmark_host.py (the
host time of an eager call beside SDPA's, and where it goes), benchmark_gluon.py (the
warp-specialized Gluon forward beside the Triton kernel and cuDNN), benchmark_gluon_backward.py
(the Gluon backward beside the Triton backward and cuDNN's) and benchmark_flash_attn_cute.py
(FlashAttention's own CuTe DSL kernels, where installed).

Counting (as FlashAttention's papers do): forward 4 * B * H * Nq * Nk * D flops (two matrix
products), backward 2.5 times that (five products: the recomputed S, dV, dP, dQ, dK), both halved
when causal. Our backward recomputes S and dP twice (once in the dK/dV kernel, once in the dQ
kernel), so it does 7/5 of the counted work; the counted number is the one comparable across
implementations. Decode is memory traffic: the bytes of K and V read, against the measured copy
bandwidth.

Every comparison is timed interleaved in one process (`kernels.bench.benchmark`: L2 flushed, device
events), against PyTorch's SDPA with the backend forced: FLASH_ATTENTION (FlashAttention-2) and
CUDNN_ATTENTION (cuDNN's fused attention), and the naive version where it fits in memory.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from kernels import bench, runtime
from kernels.bench import RESULTS_DIR
from kernels.flash_attention import reference, triton_decode, triton_flash
from kernels.testing import generator, random_tensor

TARGET_SHAPES = [(16, 16, 2048, 64), (32, 32, 4096, 128)]  # (B, H, N, D): the course's two targets
DTYPES = (torch.float16, torch.bfloat16)
ANCHORS_H200 = {  # SDPA on an H200, fp16, measured 2026-11-21: TFLOP/s
    ((16, 16, 2048, 64), False): {
        "flash fwd": 297,
        "cudnn fwd": 437,
        "flash bwd": 246,
        "cudnn bwd": 398,
    },
    ((32, 32, 4096, 128), False): {
        "flash fwd": 344,
        "cudnn fwd": 578,
        "flash bwd": 292,
        "cudnn bwd": 513,
    },
}
SWEEP_TOKENS = 16384
SWEEP_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DECODE_LENGTHS = (4096, 8192, 16384, 32768)
DECODE_SHAPE = (1, 32, 8, 128)  # batch, query heads, KV heads, head dim


def attention_flops(b, h, n_q, n_k, d, causal, backward=False) -> float:
    flops = 4.0 * b * h * n_q * n_k * d * (2.5 if backward else 1.0)
    return flops / 2 if causal else flops


def sdpa_backend(backend):
    """SDPA as (q, k, v, causal) -> out, with `backend` forced."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def implementations() -> dict:
    from torch.nn.attention import SDPBackend

    return {
        "ours": lambda q, k, v, causal: triton_flash.flash_attention(q, k, v, causal=causal),
        # the same kernel loading tiles through TMA descriptors instead of pointers (forward only:
        # its backward is the same as ours)
        "ours (TMA)": lambda q, k, v, causal: triton_flash.flash_attention_forward(
            q, k, v, causal, tma=True
        )[0],
        "sdpa flash": sdpa_backend(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa_backend(SDPBackend.CUDNN_ATTENTION),
        "naive": lambda q, k, v, causal: reference.naive_attention(q, k, v, causal=causal),
    }


def naive_fits(b, h, n_q, n_k, dtype, score_copies: float = 4.0) -> bool:
    """Whether `score_copies` (Nq x Nk) matrices fit: the naive forward holds the scores and the
    probabilities (about 2 without autograd), and its backward more."""
    free, _ = torch.cuda.mem_get_info()
    return score_copies * b * h * n_q * n_k * torch.finfo(dtype).bits // 8 < 0.8 * free


def case_keys(shape, dtype, causal) -> dict:
    """The keys that name a case in every section's rows: shape, dtype without "torch.", causal."""
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "causal": causal}


def make_inputs(b, h, n, d, dtype, seed=0, requires_grad=False, h_kv=None, n_q=None):
    g = generator(seed, "cuda")
    q = random_tensor((b, h, n_q or n, d), dtype, "cuda", g)
    k = random_tensor((b, h_kv or h, n, d), dtype, "cuda", g)
    v = random_tensor((b, h_kv or h, n, d), dtype, "cuda", g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def runs(fn) -> bool:
    """Whether `fn` runs (called once, synchronized); why not is printed."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape: report it, go on
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:160]}")
        return False


def rates(timings: dict, flops: float, direction: str) -> dict:
    """{name: ms, TFLOP/s and the ratio to cuDNN (where it ran)} from one interleaved run;
    `direction` ("fwd" or "bwd") prefixes the keys."""
    impls = {}
    for name, t in timings.items():
        impls[name] = {f"{direction}_ms": t.median_us / 1e3,
                       f"{direction}_tflops": t.tflops(flops)}  # fmt: skip
        if "sdpa cudnn" in timings:
            impls[name][f"{direction}_vs_cudnn"] = bench.ratio(timings["sdpa cudnn"], t)
    return impls


def _bind(impls: dict, *args) -> dict:
    """{name: a no-argument call of that implementation on `args`}, for bench.benchmark."""
    return {name: (lambda fn=fn: fn(*args)) for name, fn in impls.items()}


def _usable(impls: dict, q, k, v, causal) -> tuple[dict, dict]:
    """The implementations that run on these inputs (a backend may refuse a shape or dtype)."""
    ok, skipped = {}, {}
    for name, fn in impls.items():
        try:
            fn(q, k, v, causal)
            ok[name] = fn
        # noqa: BLE001 - record why a backend is missing, do not stop the run
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    torch.cuda.synchronize()
    return ok, skipped


def forward_backward(shape, dtype, causal, *, target_ms=200.0) -> dict:
    """Forward and backward of every implementation at one shape, interleaved: ms, TFLOP/s,
    ratios."""
    b, h, n, d = shape
    impls = implementations()
    if not naive_fits(b, h, n, n, dtype):
        impls.pop("naive")
    if (
        dtype != torch.float16
    ):  # the TMA comparison once per shape: its kernels take a minute to tune
        impls.pop("ours (TMA)")
    q, k, v = make_inputs(b, h, n, d, dtype, requires_grad=True)
    do = random_tensor(q.shape, dtype, "cuda", generator(1, "cuda"))
    with torch.no_grad():
        impls, skipped = _usable(impls, q, k, v, causal)  # also compiles and autotunes ours
        fwd = bench.benchmark(_bind(impls, q, k, v, causal), target_ms=target_ms)
    # Backward alone: one forward graph per implementation, differentiated again and again.
    outs = {name: fn(q, k, v, causal) for name, fn in impls.items() if name != "ours (TMA)"}
    bwd_fns = {
        name: (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        for name, o in outs.items()
    }
    if (
        "ours" in impls
    ):  # the backward with dQ by atomics (FlashAttention-2's scheme), called directly
        with torch.no_grad():
            o, lse = triton_flash.flash_attention_forward(q, k, v, causal)
        bwd_fns["ours (atomic dQ)"] = lambda: triton_flash.flash_attention_backward(
            do, q, k, v, o, lse, causal, 1.0 / math.sqrt(d), atomic_dq=True
        )
        bwd_fns["ours (atomic dQ)"]()
    bwd = bench.benchmark(bwd_fns, target_ms=target_ms)
    del outs, bwd_fns
    fwd_flops, bwd_flops = (
        attention_flops(b, h, n, n, d, causal),
        attention_flops(b, h, n, n, d, causal, True),
    )
    rows = {}
    for name in {**fwd, **bwd}:
        rows[name] = {}
        if name in fwd:
            rows[name].update(
                {
                    "fwd_ms": fwd[name].median_us / 1e3,
                    "fwd_tflops": fwd[name].tflops(fwd_flops),
                    "fwd_p10_p90_us": fwd[name].spread_us,
                }
            )
        if name in bwd:
            rows[name].update(
                {
                    "bwd_ms": bwd[name].median_us / 1e3,
                    "bwd_tflops": bwd[name].tflops(bwd_flops),
                    "bwd_p10_p90_us": bwd[name].spread_us,
                }
            )
        for base in ("sdpa flash", "sdpa cudnn"):
            if base in impls:
                if name in fwd:
                    rows[name][f"fwd_speedup_vs_{base}"] = bench.ratio(fwd[base], fwd[name])
                if name in bwd:
                    rows[name][f"bwd_speedup_vs_{base}"] = bench.ratio(bwd[base], bwd[name])
    return {**case_keys(shape, dtype, causal), "impls": rows, "skipped": skipped}


def target_shapes() -> list[dict]:
    rows = []
    for shape in TARGET_SHAPES:
        for dtype in DTYPES:
            for causal in (False, True):
                t0 = time.perf_counter()
                rows.append(forward_backward(shape, dtype, causal))
                print(
                    f"  {shape} {dtype} causal={causal}: {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    return rows


def seq_sweep(
    lengths=SWEEP_LENGTHS, head_dims=(64, 128), heads=16, dtype=torch.float16
) -> list[dict]:
    """Forward TFLOP/s against sequence length at a fixed number of tokens (batch = 16k / N), for
    the plots."""
    rows = []
    for d in head_dims:
        for causal in (False, True):
            for n in lengths:
                b = max(1, SWEEP_TOKENS // n)
                impls = implementations()
                if not naive_fits(b, heads, n, n, dtype):
                    impls.pop("naive")
                q, k, v = make_inputs(b, heads, n, d, dtype)
                with torch.no_grad():
                    impls, skipped = _usable(impls, q, k, v, causal)
                    t = bench.benchmark(_bind(impls, q, k, v, causal), target_ms=80.0)
                flops = attention_flops(b, heads, n, n, d, causal)
                for name, timing in t.items():
                    rows.append(
                        {
                            "n": n,
                            "batch": b,
                            "heads": heads,
                            "head_dim": d,
                            "causal": causal,
                            "impl": name,
                            "ms": timing.median_us / 1e3,
                            "tflops": timing.tflops(flops),
                        }
                    )
                for name, why in skipped.items():
                    rows.append(
                        {
                            "n": n,
                            "batch": b,
                            "heads": heads,
                            "head_dim": d,
                            "causal": causal,
                            "impl": name,
                            "skipped": why,
                        }
                    )
    return rows


def peak_extra_bytes(fn) -> int:
    """Peak memory allocated while `fn` runs, above what was allocated before (its output
    included)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def memory(
    shapes=((1, 16, 16384, 64), (16, 16, 2048, 64), (16, 16, 4096, 64), (16, 16, 8192, 64)),
    dtype=torch.float16,
) -> list[dict]:
    """Peak extra memory of one forward (inference: no autograd), ours vs SDPA vs naive. (16, 16, N,
    64) is the classic comparison (the fp16 score matrix alone is 2.1 GB at N = 2048)."""
    rows = []
    for shape in shapes:
        b, h, n, d = shape
        impls = implementations()
        too_big = not naive_fits(b, h, n, n, dtype, score_copies=2.2)
        if too_big:
            impls.pop("naive")
        q, k, v = make_inputs(b, h, n, d, dtype)
        with torch.no_grad():
            impls, skipped = _usable(
                impls, q, k, v, False
            )  # warm-up: autotuning allocates its own buffers
            if too_big:
                skipped["naive"] = "two score matrices would not fit in this GPU's free memory"
            row = {
                "shape": list(shape),
                "inputs_gib": 3 * q.numel() * q.element_size() / 2**30,
                "scores_gib": b * h * n * n * q.element_size() / 2**30,
                "skipped": skipped,
            }
            for name, call in _bind(impls, q, k, v, False).items():
                row[f"{name}_gib"] = peak_extra_bytes(call) / 2**30
        rows.append(row)
    return rows


def decode(
    lengths=DECODE_LENGTHS, shape=DECODE_SHAPE, dtype=torch.float16, copy_gbps=None
) -> list[dict]:
    """One query per head against a KV cache: ours (flash-decoding) vs SDPA (default dispatch, GQA),
    each called eagerly and replayed from a CUDA graph (how a serving engine runs a decode step),
    beside a device copy of the same K and V (what HBM gives a transfer this small: at 4k keys, 16
    MiB)."""
    b, hq, hkv, d = shape
    rows = []
    for n in lengths:
        q, k, v = make_inputs(b, hq, n, d, dtype, h_kv=hkv, n_q=1)
        fns = _bind(
            {
                "ours": triton_decode.flash_decode,
                "ours (flash_attention, no split)": triton_flash.flash_attention,
                "sdpa (enable_gqa)": lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True
                ),
            },
            q,
            k,
            v,
        )
        usable = {}
        for name, fn in fns.items():
            try:
                fn()
                usable[name] = fn
                if name != "ours (flash_attention, no split)":
                    usable[f"{name} graph"] = bench.capture_graph(fn).replay
            except Exception as exc:  # noqa: BLE001
                rows.append(
                    {
                        "kv_len": n,
                        "impl": name,
                        "skipped": f"{type(exc).__name__}: {str(exc)[:160]}",
                    }
                )
        k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)
        usable["copy of K and V"] = lambda: (k_copy.copy_(k), v_copy.copy_(v))
        t = bench.benchmark(usable, target_ms=100.0)
        nbytes = triton_decode.kv_bytes(k, v)
        for name, timing in t.items():
            moved = (
                2 * nbytes if name == "copy of K and V" else nbytes
            )  # a copy reads and writes them
            row = {
                "kv_len": n,
                "impl": name,
                "us": timing.median_us,
                "gbps": timing.gbps(moved),
                "splits": triton_decode.default_num_splits(b, hkv, n)
                if name in ("ours", "ours graph")
                else None,
            }
            if copy_gbps:
                row["fraction_of_copy"] = row["gbps"] / copy_gbps
            rows.append(row)
    return rows


def decode_split_sweep(
    lengths=(4096, 16384, 32768),
    shape=DECODE_SHAPE,
    dtype=torch.float16,
    splits=(8, 17, 33),
    block_ns=(64, 128),
    stages=(2, 3, 4),
    warps=(4, 8),
) -> list[dict]:
    """GB/s of flash_decode against the number of splits, the key block, the pipeline depth and the
    warps (fused combine), and the default configuration with the combine as a second launch, to
    choose the defaults. Configurations whose pipeline does not fit in shared memory are reported as
    skipped."""
    b, hq, hkv, d = shape
    rows = []
    for n in lengths:
        q, k, v = make_inputs(b, hq, n, d, dtype, h_kv=hkv, n_q=1)
        fns = {
            f"splits={s} block_n={bn} stages={st} warps={w}": (
                lambda s=s, bn=bn, st=st, w=w: triton_decode.flash_decode(
                    q, k, v, num_splits=s, block_n=bn, num_stages=st, num_warps=w
                )
            )
            for s in splits
            for bn in block_ns
            for st in stages
            for w in warps
        }
        fns["default, combine-launch"] = lambda: triton_decode.flash_decode(
            q, k, v, fuse_combine=False
        )
        usable = {}
        for name, fn in fns.items():
            try:
                fn()
                usable[name] = fn
            # noqa: BLE001  (out of shared memory: that configuration does not exist)
            except Exception as exc:
                rows.append(
                    {
                        "kv_len": n,
                        "config": name,
                        "skipped": f"{type(exc).__name__}: {str(exc)[:120]}",
                    }
                )
        t = bench.benchmark(usable, target_ms=150.0)
        nbytes = triton_decode.kv_bytes(k, v)
        rows += [
            {"kv_len": n, "config": name, "us": tm.median_us, "gbps": tm.gbps(nbytes)}
            for name, tm in t.items()
        ]
    return rows


def autotune_choices() -> dict:
    """The configuration the autotuner picked for each key it saw (BLOCK_M, BLOCK_N, warps,
    stages)."""
    out = {}
    for name, kernel in (
        ("forward", triton_flash.flash_fwd_kernel),
        ("dkdv", triton_flash.flash_bwd_dkdv_kernel),
        ("dq", triton_flash.flash_bwd_dq_kernel),
    ):
        out[name] = {
            str(
                key
            ): f"M{c.kwargs['BLOCK_M']} N{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
            for key, c in getattr(kernel, "cache", {}).items()
        }
    return out


def case_label(row: dict) -> str:
    """A case in words: "(16, 16, 2048, 64) float16 causal"."""
    return f"{tuple(row['shape'])} {row['dtype']}{' causal' if row['causal'] else ''}"


def passed(checks: list[dict]) -> list[dict]:
    """The checks, each with "pass": whether its value reaches its threshold."""
    return [{**c, "pass": bool(c["value"] >= c["threshold"])} for c in checks]


def performance_targets(results: dict) -> list[dict]:
    checks = []
    for row in results.get("targets", []):
        impls = row["impls"]
        label = case_label(row)
        ours = impls.get("ours", {})
        # targets for the default paths; the TMA forward and the atomic-dQ backward are reported
        # beside them
        for direction in ("fwd", "bwd"):
            if "sdpa flash" in impls and f"{direction}_speedup_vs_sdpa flash" in ours:
                checks.append(
                    {
                        "target": f"{direction} {label}: ours >= SDPA flash (FA2)",
                        "value": ours[f"{direction}_speedup_vs_sdpa flash"],
                        "threshold": 1.0,
                    }
                )
        if "sdpa flash" in impls and "bwd_speedup_vs_sdpa flash" in impls.get(
            "ours (atomic dQ)", {}
        ):
            checks.append(
                {
                    "target": f"bwd {label}: ours (atomic dQ) >= SDPA flash (FA2)",
                    "value": impls["ours (atomic dQ)"]["bwd_speedup_vs_sdpa flash"],
                    "threshold": 1.0,
                }
            )
        for name in ("ours", "ours (TMA)"):
            if "sdpa cudnn" in impls and name in impls:
                checks.append(
                    {
                        "target": f"fwd {label}: {name} >= 80% of cuDNN (aim)",
                        "value": impls[name]["fwd_speedup_vs_sdpa cudnn"],
                        "threshold": 0.8,
                    }
                )
    for row in results.get("memory", []):
        if row["shape"] == [1, 16, 16384, 64] and "ours_gib" in row and "sdpa flash_gib" in row:
            checks.append(
                {
                    "target": "peak extra memory (1,16,16384,64): ours <= 1.1x SDPA flash",
                    "value": row["sdpa flash_gib"] * 1.1 / row["ours_gib"],
                    "threshold": 1.0,
                }
            )
    for row in results.get("decode", []):
        if row["impl"] in ("ours", "ours graph") and "fraction_of_copy" in row:
            checks.append(
                {
                    "target": f"decode KV {row['kv_len']} ({row['impl']}): >= 70% of copy "
                    "bandwidth "
                    "reading K, V",
                    "value": row["fraction_of_copy"],
                    "threshold": 0.7,
                }
            )
    return passed(checks)


def print_checks(checks: list[dict]) -> None:
    if checks:
        print(
            bench.table(
                [{k: c[k] for k in ("target", "value", "threshold", "pass")} for c in checks],
                floatfmt=".3f",
            )
        )


def print_cases(rows: list[dict], note) -> None:
    """A table of the implementations for each case, headed by the case and `note(row)`."""
    for row in rows:
        print(f"\n{tuple(row['shape'])} {row['dtype']} causal={row['causal']} ({note(row)})")
        print(bench.table([{"impl": k, **v} for k, v in row["impls"].items()], floatfmt=".3f"))


def run_to_own_file(name: str, measure, targets, show) -> int:
    """Run a benchmark that has a file of its own: data/results/<gpu>/03_flash_attention_<name>.json
    holds {"fingerprint", name: what `measure()` returns, "seconds", "checks": `targets` of it};
    prints the checks and `show`s the measurement. Exit status 0 when every check passes, 2 when
    one fails, 1 without a GPU."""
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    t0 = time.perf_counter()
    print(f"{name} ...", flush=True)
    results = {"fingerprint": runtime.fingerprint(), name: measure()}
    results["seconds"] = time.perf_counter() - t0
    results["checks"] = targets(results[name])
    path = bench.save_results(f"03_flash_attention_{name}", results)
    print_checks(results["checks"])
    show(results[name])
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in results["checks"]) else 2


SECTIONS = ("targets", "sweep", "memory", "decode", "decode_splits")


def main(argv: list[str]) -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    sections = [s for s in argv if s in SECTIONS] or list(SECTIONS)
    unknown = [s for s in argv if s not in SECTIONS]
    if unknown:
        print(
            f"unknown sections {unknown}; choose from {SECTIONS} (host, gluon, gluon_backward and "
            "flash_attn_cute: python -m kernels.flash_attention.benchmark_<name>)"
        )
        return 1
    ceilings = bench.ceilings()
    path = RESULTS_DIR / runtime.gpu_info().slug / "03_flash_attention.json"
    # A run of some sections updates them in the existing record (one file, whether the run was
    # split over several calls or not); each section carries its own fingerprint.
    results = (
        json.loads(path.read_text()) if len(sections) < len(SECTIONS) and path.exists() else {}
    )
    results.update(
        {
            "fingerprint": runtime.fingerprint(),
            "ceilings": {k: v for k, v in ceilings.items() if k != "fingerprint"},
            "anchors_h200_fp16": {f"{s} causal={c}": v for (s, c), v in ANCHORS_H200.items()},
        }
    )
    runners = {
        "targets": target_shapes,
        "sweep": seq_sweep,
        "memory": memory,
        "decode": lambda: decode(copy_gbps=ceilings["copy_gbps"]),
        "decode_splits": decode_split_sweep,
    }
    for section in sections:
        t0 = time.perf_counter()
        print(f"{section} ...", flush=True)
        results[section] = runners[section]()
        results.setdefault("seconds", {})[section] = time.perf_counter() - t0
        results.setdefault("section_fingerprints", {})[section] = runtime.fingerprint()
    results.setdefault("autotune", {}).update(
        {f"{k} ({'+'.join(sections)})": v for k, v in autotune_choices().items()}
    )
    results["checks"] = performance_targets(results)
    path = bench.save_results("03_flash_attention", results)
    report(results)
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in results["checks"]) else 2


def report(results: dict) -> None:
    print_checks(results.get("checks"))
    for row in results.get("targets", []):
        print(
            f"\n{tuple(row['shape'])} {row['dtype']} causal={row['causal']}  "
            f"(skipped: {row['skipped'] or '-'})"
        )
        print(
            bench.table(
                [
                    {
                        "impl": name,
                        **{k: v for k, v in r.items() if not isinstance(v, (list, tuple))},
                    }
                    for name, r in row["impls"].items()
                ],
                floatfmt=".2f",
            )
        )
    if results.get("memory"):
        print("\npeak extra memory, one forward (GiB)")
        print(
            bench.table(
                [{k: v for k, v in r.items() if k != "skipped"} for r in results["memory"]],
                floatfmt=".3f",
            )
        )
    if results.get("decode"):
        print("\ndecode")
        print(bench.table([r for r in results["decode"] if "skipped" not in r], floatfmt=".2f"))
    for n in sorted({r["kv_len"] for r in results.get("decode_splits", [])}):
        rows = sorted(
            (r for r in results["decode_splits"] if r["kv_len"] == n and "gbps" in r),
            key=lambda r: -r["gbps"],
        )
        print(
            f"\ndecode split sweep at KV {n}: "
            + ", ".join(f"{r['config']} {r['gbps']:.0f}" for r in rows[:4])
            + f" GB/s ... worst {rows[-1]['config']} {rows[-1]['gbps']:.0f}"
        )
    if results.get("autotune"):
        print("\nautotuner choices:", json.dumps(results["autotune"], indent=1))
    if isinstance(results.get("seconds"), dict):
        print("seconds per section:", {k: round(v) for k, v in results["seconds"].items()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
