"""Compile every Triton kernel of the course for GPU architectures, without a GPU.

    python tools/compile_all.py                      # every architecture of runtime.COMPILE_ARCHS
    python tools/compile_all.py --arch sm_80 --arch sm_89 --json build/compile.json

Each architecture compiles in its own process, the processes in parallel. A process sets
KERNELS_COMPILE_ONLY=1 and KERNELS_TARGET_ARCH before importing `kernels`, so `runtime.features()`
answers for that target and every gate (`runtime.has`, `runtime.shared_memory_budget`) picks the
path and the tiles that GPU takes. Each kernel of `kernels.feature_table.KERNELS` is compiled with
`triton.compile` for GPUTarget("cuda", cc, 32) in the configurations its wrappers launch (a
representative set of their constexpr values); where the table says a kernel cannot exist, it is not
compiled. A configuration passes when Triton and ptxas compile it and its shared memory fits the
target's budget. Only Triton runs here: it needs no driver, and its cache (TRITON_CACHE_DIR, by
default ~/.cache/gpu-kernels-course/triton) keys every binary by source, options, target and
Triton version, so a second run compiles only what changed.

Run under another Triton by calling this file with that environment's Python. The result is one JSON
line per configuration ({"arch", "kernel", "config", "ok", "shared", "budget", "error"}) and a count
per architecture; the exit status is 1 when any configuration failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Outside the clone, so a fresh clone on the same machine (CI's) finds what an earlier run compiled;
# Triton keys every binary by source, options, target and its own version.
DEFAULT_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "gpu-kernels-course"
    / "triton"
)

# Parameter types by name, for the kernels' non-constexpr arguments: integer pointers, float32
# pointers, float scalars, integer scalars named in capitals; other capitals are data pointers.
INT_POINTER = re.compile(
    r"ids|count|offset|expert|base|row_of|pos|status|arrivals|indices|target|"
    r"n_valid|plan",
    re.I,
)
FLOAT32_POINTER = re.compile(
    r"lse|rstd|scale|amax|partial|loss|values|delta|probs|weights|dq_acc|o_part", re.I
)
FLOAT_SCALAR = re.compile(r"eps|scale|reading|value")
INT_CAPITALS = re.compile(r"^([MNK]|\w+_BUCKET)$")


def signature(kernel, data: str, constants: dict, types: dict) -> tuple[dict, dict]:
    """(signature, constexprs) for ASTSource: every parameter typed by `types`, else by name."""
    sig, constexprs = {}, {}
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            if name not in constants:
                raise KeyError(f"{kernel.__name__}: no value for constexpr {name}")
            sig[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        elif name in types:
            sig[name] = types[name]
        elif (
            name.endswith("_ptr")
            or (name.isupper() and not INT_CAPITALS.match(name))
            or (
                name == "K"
                and any(p.name == "V" for p in kernel.params)  # attention's K, not a size
            )
        ):
            bare = name.removesuffix("_ptr")
            kind = (
                "i32"
                if INT_POINTER.search(bare)
                else "fp32"
                if FLOAT32_POINTER.search(bare)
                else data
            )
            sig[name] = "*" + kind
        else:
            sig[name] = "fp32" if FLOAT_SCALAR.search(name) else "i32"
    return sig, constexprs


def configurations(arch: str):
    """(kernel key, label, data dtype, constants, types, options) for every configuration compiled
    for `arch`; called in a process whose `runtime.features()` answers for `arch`."""
    import triton
    import triton.language as tl

    from kernels import feature_table, runtime
    from kernels.decoder import pdl
    from kernels.flash_attention import triton_flash
    from kernels.mixed_precision import triton_fp8
    from kernels.moe import triton_grouped_gemm, triton_grouped_gemm_tma
    from kernels.rmsnorm import triton_pdl

    found = runtime.features()
    half = "bf16" if found.bf16 else "fp16"  # sm_75: the course refuses bf16 products there
    # the decoder's graph kernels as Decoder(pdl=True) launches them: the wait where PDL exists
    decode_pdl = {"PDL": pdl.launch_options(True).get("PDL", False)}
    out = []

    def add(key, label, data, constants, types=None, **options):
        out.append((key, label, data, constants, types or {}, options or {"num_warps": 4}))

    add("elementwise_add.triton_add:add_kernel", "fp32", "fp32", {"BLOCK": 1024})
    add("elementwise_add.triton_add:add_kernel", "bf16", half, {"BLOCK": 2048})
    for exact in (False, True):
        add(
            "elementwise_add.triton_add:residual_add_kernel",
            f"exact={exact}",
            half,
            {"BLOCK": 1024, "EXACT_ORDER": exact},
        )
    add("profiling.transpose:transpose_naive_kernel", "32", "fp32", {"BLOCK": 32})
    add(
        "profiling.transpose:transpose_tiled_kernel",
        "32x32",
        "fp32",
        {"BLOCK_R": 32, "BLOCK_C": 32},
    )
    add("profiling.lab:_answer_kernel", "one", "fp32", {}, num_warps=1)
    for dtype, acc in ((half, tl.float32), ("fp32", tl.float32), ("fp64", tl.float64)):
        add(
            "rmsnorm.triton_rmsnorm:rmsnorm_fwd_kernel",
            dtype,
            dtype,
            {"ROWS": 1, "BLOCK": 4096, "STORE_RSTD": True, "ACC": acc},
            num_warps=8,
        )
    fp8_input = "fp8e4nv" if runtime.has("fp8") else "fp32"  # rms_norm_fp8 upcasts without fp8
    add(
        "rmsnorm.triton_rmsnorm:rmsnorm_fwd_kernel",
        f"{fp8_input} in",
        half,
        {"ROWS": 4, "BLOCK": 1024, "STORE_RSTD": False, "ACC": tl.float32},
        {"x_ptr": "*" + fp8_input},
        num_warps=8,
    )
    add(
        "rmsnorm.triton_rmsnorm:fused_add_rmsnorm_kernel",
        half,
        half,
        {"ROWS": 1, "BLOCK": 4096},
        num_warps=8,
    )
    add(
        "rmsnorm.triton_rmsnorm:rmsnorm_bwd_kernel",
        half,
        half,
        {"BLOCK": 4096, "ACC": tl.float32},
        {"dw_partial_ptr": "*fp32"},
        num_warps=8,
    )
    add(
        "rmsnorm.triton_rmsnorm:sum_partials_kernel",
        "fp32",
        "fp32",
        {"BLOCK_P": 32, "BLOCK_W": 128, "ACC": tl.float32},
    )
    for rows in (16, 64, 1024, 4096):  # one per entry of triton_pdl.GPU_TILES, as the GPU picks
        bm, bn, bk, warps, stages = triton_pdl.gpu_tile(rows)
        add(
            "rmsnorm.triton_pdl:matmul_kernel",
            f"{rows} rows",
            half,
            {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": triton_pdl.GROUP_M,
                "EVEN_K": True,
                "UPCAST": False,
                "LAUNCH_DEPENDENTS": triton_pdl.launch_dependents(),
            },
            num_warps=warps,
            num_stages=stages,
        )
    if runtime.has("pdl"):  # elsewhere rms_norm_pdl runs the plain kernel
        pdl_norm = "rmsnorm.triton_pdl:rmsnorm_pdl_kernel"
        add(pdl_norm, half, half, {"ROWS": 1, "BLOCK": 4096}, num_warps=8)
    add(
        "memory_profiling.triton_cross_entropy:_softmax_loss_grad_kernel",
        half,
        half,
        {"BLOCK_V": 4096},
        {"targets_ptr": "*i64"},
        num_warps=8,
    )
    add(
        "memory_profiling.triton_chunked_loss:_token_loss_kernel",
        half,
        half,
        {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_H": 64, "UPCAST": False, "IEEE": False},
        {"targets_ptr": "*i64"},
        num_warps=8,
    )
    for algo in (0, 1, 2):
        add(
            "mixed_precision.triton_reduce:sum_kernel",
            f"algorithm {algo}",
            "fp32",
            {
                "ALGO": algo,
                "ACC": tl.float32,
                "BLOCK": 4096,
                "LOG2_BLOCK": 12,
                "TRIPS": 32,
                "FINAL": False,
            },
            num_warps=8,
        )
    import torch

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        constants = triton_fp8.fp8_constants(fp8, pow2=True)
        stored = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}[fp8]
        stored = stored if runtime.has("fp8") else "fp32"  # quantize's path without fp8
        add(
            "mixed_precision.triton_fp8:quantize_blocks_kernel",
            stored,
            "fp32",
            {"BLOCK": 128, "GROUPS": 32, **constants},
            {"q_ptr": "*" + stored},
        )
        add(
            "mixed_precision.triton_fp8:quantize_tensor_kernel",
            stored,
            "fp32",
            {"TILE": 4096, **constants},
            {"q_ptr": "*" + stored},
        )
        add(
            "mixed_precision.triton_fp8:dequantize_kernel",
            stored,
            half,
            {"BLOCK": 128, "TILE": 4096, "PER_TENSOR": False},
            {"q_ptr": "*" + stored},
        )
        add(
            "mixed_precision.triton_fp8:fake_quantize_kernel",
            str(fp8),
            half,
            {"BLOCK": 128, "GROUPS": 32, **constants},
        )
    add("mixed_precision.triton_fp8:amax_kernel", "4096", "fp32", {"TILE": 4096})

    # attention: every forward and backward tile the tables keep for head dims 64 and 128
    for head_dim in (64, 128):
        common = {"HEAD_DIM": head_dim, "HEAD_PAD": head_dim, "CAUSAL": True, "UPCAST": False}
        for bm, bn, warps, stages in triton_flash.fitting_tiles("forward", head_dim):
            tma = runtime.has("tma") and (bm, bn) == (128, 64)
            add(
                "flash_attention.triton_flash:flash_fwd_kernel",
                f"d{head_dim} {bm}x{bn} w{warps} s{stages}{' tma' if tma else ''}",
                half,
                {**common, "TMA": tma, "BLOCK_M": bm, "BLOCK_N": bn},
                num_warps=warps,
                num_stages=stages,
            )
        for bm, bn, warps, stages in triton_flash.fitting_tiles("dkdv", head_dim):
            add(
                "flash_attention.triton_flash:flash_bwd_dkdv_kernel",
                f"d{head_dim} {bm}x{bn} w{warps} s{stages}",
                half,
                {**common, "ATOMIC_DQ": False, "BLOCK_M": bm, "BLOCK_N": bn},
                num_warps=warps,
                num_stages=stages,
            )
        for bm, bn, warps, stages in triton_flash.fitting_tiles("dq", head_dim):
            add(
                "flash_attention.triton_flash:flash_bwd_dq_kernel",
                f"d{head_dim} {bm}x{bn} w{warps} s{stages}",
                half,
                {**common, "BLOCK_M": bm, "BLOCK_N": bn},
                num_warps=warps,
                num_stages=stages,
            )
        add(
            "flash_attention.triton_flash:flash_bwd_preprocess_kernel",
            f"d{head_dim}",
            half,
            {"HEAD_DIM": head_dim, "HEAD_PAD": head_dim, "BLOCK_M": 64},
        )
        add(
            "flash_attention.triton_decode:flash_decode_split_kernel",
            f"d{head_dim}",
            half,
            {
                "HEAD_DIM": head_dim,
                "HEAD_PAD": head_dim,
                "BLOCK_H": 16,
                "BLOCK_N": 64,
                "CAUSAL": False,
                "UPCAST": False,
                "FUSE_COMBINE": True,
                "BLOCK_R": 16,
                "BLOCK_S": 16,
            },
        )
        add(
            "flash_attention.triton_decode:flash_decode_combine_kernel",
            f"d{head_dim}",
            half,
            {"HEAD_DIM": head_dim, "HEAD_PAD": head_dim, "BLOCK_R": 16, "BLOCK_S": 16},
        )
        add(
            "decoder.triton_attention:cache_attention_split_kernel",
            f"d{head_dim}",
            half,
            {
                "HEAD_DIM": head_dim,
                "BLOCK_H": 16,
                "BLOCK_N": 64,
                "SPLIT_KEYS": 128,
                "UPCAST": False,
                "PRECISION": "ieee",
                "FUSE_COMBINE": True,
                "BLOCK_R": 16,
                "BLOCK_S": 16,
                **decode_pdl,
            },
        )
        add(
            "decoder.triton_attention:cache_attention_combine_kernel",
            f"d{head_dim}",
            half,
            {"HEAD_DIM": head_dim, "SPLIT_KEYS": 128, "BLOCK_S": 16, **decode_pdl},
        )

    permute = {"E_PAD": 64, "BLOCK": 16384 // 64}  # triton_permute's GPU block for 64 experts
    add("moe.triton_permute:histogram_kernel", "64 experts", "i32", permute, num_warps=8)
    add(
        "moe.triton_permute:scan_kernel",
        "64 experts",
        "i32",
        {"BLOCK_M": 128, "E_PAD": 64, "BLOCK_B": 64, "BLOCK_TILES": 256},
    )
    add("moe.triton_permute:place_kernel", "64 experts", "i32", permute, num_warps=8)
    add(
        "moe.triton_router:router_kernel",
        half,
        half,
        {"TOP_K": 2, "E_PAD": 64, "BLOCK_T": 16, "BLOCK_H": 128, "UPCAST": False},
        {"weights_ptr": "*fp32", "probs_ptr": "*fp32"},
    )
    add(
        "moe.triton_combine:combine_kernel", half, half, {"TOP_K": 2, "BLOCK_T": 16, "BLOCK_H": 256}
    )
    for block_m in (64, 128):
        for swiglu in (False, True):
            for config in triton_grouped_gemm.fitting_configs(block_m, swiglu):
                add(
                    "moe.triton_grouped_gemm:grouped_gemm_kernel",
                    f"M{block_m} swiglu={swiglu} "
                    f"{config.kwargs} w{config.num_warps} s{config.num_stages}",
                    half,
                    {
                        "TOP_K": 2,
                        "GATHER": swiglu,
                        "SWIGLU": swiglu,
                        "BLOCK_M": block_m,
                        "EVEN_K": True,
                        "UPCAST": False,
                        **config.kwargs,
                    },
                    num_warps=config.num_warps,
                    num_stages=config.num_stages,
                )
    if runtime.has("tma"):
        for config in triton_grouped_gemm_tma.fitting_configs(128, True, True)[:2]:
            bn, bk = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
            desc = "tensordesc<{}[{}, {}]>".format
            add(
                "moe.triton_grouped_gemm_tma:grouped_gemm_tma_kernel",
                f"{config.kwargs} w{config.num_warps} s{config.num_stages}",
                half,
                {
                    "TOP_K": 2,
                    "GATHER": False,
                    "SWIGLU": True,
                    "INTERLEAVED": True,
                    "PERSISTENT": True,
                    "BLOCK_M": 128,
                    "UPCAST": False,
                    **config.kwargs,
                },
                {
                    "a_desc": desc(half, 128, bk),
                    "w1_desc": desc(half, 2 * bn, bk),
                    "w2_desc": desc(half, bn, bk),
                    "c_desc": desc(half, 128, bn),
                },
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
    add(
        "moe.triton_grouped_gemm_tma:gather_rows_kernel",
        half,
        half,
        {"TOP_K": 2, "BLOCK_M": 128, "BLOCK_K": 128},
        num_warps=8,
    )

    add(
        "decoder.triton_ops:embedding_kernel",
        half,
        half,
        {"BLOCK": 1024, "FLAG": 1},
        {"IDS": "*i64"},
    )
    add("decoder.triton_ops:swiglu_kernel", half, half, {"BLOCK": 1024})
    add(
        "decoder.triton_ops:argmax_chunk_kernel",
        half,
        half,
        {"CHUNK": 4096, **decode_pdl},
        {"VALUES": "*fp32", "INDICES": "*i32"},
    )
    add(
        "decoder.triton_ops:argmax_final_kernel",
        "fp32",
        "fp32",
        {"BLOCK_CHUNKS": 64, **decode_pdl},
        {"OUT": "*i64"},
    )
    add(
        "decoder.triton_rope:rope_kernel",
        half,
        half,
        {"BLOCK_H": 32, "BLOCK_D": 64},
        {"INV_FREQ": "*fp32"},
    )
    add(
        "decoder.triton_rope:rope_append_kernel",
        half,
        half,
        {"BLOCK_H": 32, "BLOCK_D": 64, **decode_pdl},
        {"INV_FREQ": "*fp32"},
    )
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): one decode row broadcast, 16 rows by dot
    for use_dot, (bm, bn, bk, warps, stages) in (
        (False, (1, 4, 512, 4, 3)),
        (True, (16, 16, 64, 4, 3)),
    ):
        add(
            "decoder.triton_fused_gemv:add_norm_linear_kernel",
            f"dot={use_dot}",
            half,
            {
                "HAS_DELTA": True,
                "SWIGLU": True,
                "STATISTICS_FIRST": True,
                "UPCAST": False,
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "USE_DOT": use_dot,
                **decode_pdl,
            },
            {"NORM_W": "*" + half},
            num_warps=warps,
            num_stages=stages,
        )
    for use_dot, (bm, bn, bk, warps, stages) in (
        (False, (1, 4, 512, 4, 3)),
        (True, (16, 16, 256, 4, 4)),
    ):
        add(
            "decoder.triton_gemv:skinny_linear_kernel",
            f"dot={use_dot}",
            half,
            {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "USE_DOT": use_dot,
                "UPCAST": False,
                **decode_pdl,
            },
            num_warps=warps,
            num_stages=stages,
        )

    from kernels.decoder import persistent_offline

    # the decode step as one kernel, as PersistentStep launches it for Llama-3.2-1B at batch 1
    add(
        "decoder.triton_persistent_step:persistent_step_kernel",
        f"1b {half} batch 1",
        half,
        {},
        {
            "compile": functools.partial(
                persistent_offline.compile_for, arch, dtype="bfloat16" if found.bf16 else "float16"
            )
        },
    )

    tiled = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "UPCAST": False}
    add("matmul.triton_matmul:matmul_kernel", half, half, tiled, num_warps=8, num_stages=3)
    add(
        "matmul.triton_matmul:matmul_persistent_kernel",
        half,
        half,
        {**tiled, "PROGRAMS": found.sm_count},
        num_warps=8,
        num_stages=3,
    )
    add(
        "matmul.triton_skinny:split_k_kernel",
        half,
        half,
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "UPCAST": False},
        {"partial_ptr": "*fp32", "K_PER_SPLIT": "i32"},
        num_warps=8,
        num_stages=4,
    )
    add(
        "matmul.triton_skinny:sum_splits_kernel",
        "4 splits",
        half,
        {"SPLITS": 4, "BLOCK": 1024},
        {"partial_ptr": "*fp32"},
    )
    from kernels.matmul import gluon_matmul, triton_fp8_matmul, triton_matmul_tma

    for key, module, feature in (  # compiled by each module's own compile_for(arch)
        ("matmul.triton_matmul_tma:matmul_tma_kernel", triton_matmul_tma, "tma"),
        ("matmul.triton_fp8_matmul:fp8_matmul_kernel", triton_fp8_matmul, "fp8"),
        ("matmul.gluon_matmul:gluon_matmul_kernel", gluon_matmul, "wgmma"),
    ):
        if runtime.has(feature):
            compile_here = functools.partial(module.compile_for, arch)
            add(key, "default tile", half, {}, {"compile": compile_here})
    if runtime.has("wgmma"):  # the Gluon kernels, each in its default schedule
        from kernels.flash_attention import gluon_flash, gluon_flash_backward

        for key, module in (
            ("flash_attention.gluon_flash:gluon_fwd_kernel", gluon_flash),
            ("flash_attention.gluon_flash_backward:gluon_bwd_kernel", gluon_flash_backward),
        ):
            compile_gluon = functools.partial(module.compile_for_hopper, 128, torch.float16, True)
            add(key, "d128 causal, default schedule", half, {}, {"compile": compile_gluon})

    for key, *_ in out:
        if arch in feature_table.cannot_exist(key):
            raise AssertionError(
                f"{key} is configured for {arch}, where the table says it cannot exist"
            )
    del triton
    return out


def _jit_function(key: str):
    module, name = key.split(":")
    kernel = getattr(importlib.import_module("kernels." + module), name)
    while not hasattr(kernel, "params"):  # autotuner and heuristics wrappers
        kernel = kernel.fn
    return kernel


def compile_one_arch(arch: str) -> None:
    """In a process set up for `arch` (see `main`): compile every configuration, print a JSON line
    for each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import runtime

    cc = int(arch.removeprefix("sm_"))
    budget = runtime.shared_memory_budget()
    first_only = os.environ.get("COMPILE_CONFIGS") == "first"
    seen = set()
    for key, label, data, constants, types, options in configurations(arch):
        if first_only and key in seen:
            continue
        seen.add(key)
        row = {"arch": arch, "kernel": key, "config": label, "budget": budget}
        start = time.perf_counter()
        try:
            if "compile" in types:  # a module's own compile (Gluon, TMA, fp8, the persistent step)
                compiled = types["compile"]()
            else:
                kernel = _jit_function(key)
                sig, constexprs = signature(kernel, data, constants, types)
                compiled = triton.compile(
                    ASTSource(kernel, sig, constexprs),
                    target=GPUTarget("cuda", cc, 32),
                    options=options,
                )
            shared = compiled.metadata.shared
            row |= {"ok": shared <= budget, "shared": shared}
            if shared > budget:
                row["error"] = f"{shared} bytes of shared memory, over the budget of {budget}"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next runs
            text = str(exc).split("nanobind: leaked")[0].strip()
            row |= {"ok": False, "shared": None, "error": f"{type(exc).__name__}: {text[-1500:]}"}
        row["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(row), flush=True)


def run_arch(
    arch: str, cache: Path, python: str = sys.executable, configs: str = "all"
) -> list[dict]:
    """Compile everything for `arch` in a fresh process; its rows (a crash is one failed row).
    configs="first" compiles each kernel's first configuration only."""
    env = dict(
        os.environ,
        COMPILE_CONFIGS=configs,
        KERNELS_COMPILE_ONLY="1",
        KERNELS_TARGET_ARCH=arch,
        TRITON_CACHE_DIR=str(cache),
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("TRITON_INTERPRET", None)
    env.pop("KERNELS_GPU_PROFILE", None)
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--one", arch],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"arch"')]
    if done.returncode != 0:
        error = done.stderr.split("nanobind: leaked")[0][-3000:]
        rows.append(
            {
                "arch": arch,
                "kernel": "(process)",
                "config": "",
                "ok": False,
                "shared": None,
                "budget": None,
                "error": f"exit status {done.returncode}: {error}",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="sm_80 ... (repeat; default: all)")
    parser.add_argument("--json", type=Path, help="write every row to this file")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--configs",
        choices=("all", "first"),
        default="all",
        help="every configuration the wrappers launch, or each kernel's first (the CI test)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the per-architecture process
    args = parser.parse_args(argv)
    if args.one:
        compile_one_arch(args.one)
        return 0
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("KERNELS_MODE", "cpu")  # the parent only reads the table
    from kernels.runtime import COMPILE_ARCHS

    archs = args.arch or list(COMPILE_ARCHS)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(
            pool.map(lambda arch: run_arch(arch, args.cache, configs=args.configs), archs)
        )
    rows = [row for arch_rows in results for row in arch_rows]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for arch, arch_rows in zip(archs, results):
        failed = [row for row in arch_rows if not row["ok"]]
        print(f"{arch}: {len(arch_rows) - len(failed)} of {len(arch_rows)} configurations compiled")
        for row in failed:
            print(f"  FAILED {row['kernel']} [{row['config']}]: {row['error']}")
    return 1 if any(not row["ok"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
