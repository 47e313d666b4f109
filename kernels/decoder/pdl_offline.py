"""The decode step's Triton kernels compiled for a GPU this machine may not have, with and without
programmatic dependent launch: the PTX says whether the wait made it in.

    python -m kernels.decoder.pdl_offline [sm_90|sm_80]

compiles each kernel the way its wrapper launches it at batch 1 (bf16, Llama-3.2-1B's shapes),
once with `pdl=False` and once with `pdl=True`, and prints the `griddepcontrol` instructions in
each. For sm_90 the PDL variants carry `griddepcontrol.wait` and `.launch_dependents` and the
default ones carry neither; for sm_80 the PDL request compiles to the plain kernel (`launch_options`
asks `runtime.has("pdl")`, which answers for the compile target), so an A100 never sees it.
tests/test_decoder_pdl.py checks both, through `compile_offline` (a process of its own).
"""

from __future__ import annotations

import json
import sys

from kernels.compile_report import run_compile_script
from kernels.decoder.pdl import launch_options

# kernel name -> (module, pointer types by argument, float arguments, constexprs, warps): a batch-1
# launch at the Llama-3.2-1B shape, as the wrapper makes it on a GPU
KERNELS = {
    "skinny_linear_kernel": (
        "triton_gemv",
        {"X": "bf16", "W": "bf16", "Y": "bf16"},
        (),
        {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "USE_DOT": False, "UPCAST": False},
        4,
    ),
    "add_norm_linear_kernel": (
        "triton_fused_gemv",
        dict.fromkeys(["DELTA", "RESIDUAL", "NORM_W", "RESIDUAL_OUT", "W", "OUT"], "bf16"),
        ("eps",),
        {
            "HAS_DELTA": True,
            "SWIGLU": True,
            "STATISTICS_FIRST": False,
            "UPCAST": False,
            "BLOCK_M": 1,
            "BLOCK_N": 4,
            "BLOCK_K": 512,
            "USE_DOT": False,
        },
        4,
    ),
    "rope_append_kernel": (
        "triton_rope",
        {
            "QKV": "bf16",
            "POS": "i32",
            "INV_FREQ": "fp32",
            "K_CACHE": "bf16",
            "V_CACHE": "bf16",
            "STATUS": "i32",
        },
        ("scale",),
        {"BLOCK_H": 8, "BLOCK_D": 32},
        4,
    ),
    "cache_attention_split_kernel": (
        "triton_attention",
        {
            "Q": "bf16",
            "K": "bf16",
            "V": "bf16",
            "POS": "i32",
            "O_PART": "fp32",
            "LSE_PART": "fp32",
            "OUT": "bf16",
            "ARRIVALS": "i32",
        },
        ("qk_scale",),
        {
            "HEAD_DIM": 64,
            "BLOCK_H": 16,
            "BLOCK_N": 64,
            "SPLIT_KEYS": 128,
            "UPCAST": False,
            "PRECISION": None,
            "FUSE_COMBINE": False,
            "BLOCK_R": 4,
            "BLOCK_S": 8,
        },
        4,
    ),
    "cache_attention_combine_kernel": (
        "triton_attention",
        {"O_PART": "fp32", "LSE_PART": "fp32", "POS": "i32", "OUT": "bf16"},
        (),
        {"HEAD_DIM": 64, "SPLIT_KEYS": 128, "BLOCK_S": 32},
        2,
    ),
    "argmax_chunk_kernel": (
        "triton_ops",
        {"X": "bf16", "VALUES": "fp32", "INDICES": "i32"},
        (),
        {"CHUNK": 4096},
        8,
    ),
    "argmax_final_kernel": (
        "triton_ops",
        {"VALUES": "fp32", "INDICES": "i32", "OUT": "i64"},
        (),
        {"BLOCK_CHUNKS": 32},
        1,
    ),
}

_SCRIPT = """
import json, sys
from kernels.decoder import pdl_offline
for options in json.loads(sys.argv[1]):
    ptx = pdl_offline.compile_for(sys.argv[2], **options).asm["ptx"]
    sys.stdout.flush()
    print(json.dumps({
        "wait": ptx.count("griddepcontrol.wait"),
        "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
        "target": ptx.split(".target", 1)[1].split()[0]}), flush=True)
"""


def compile_for(arch: str, kernel: str, pdl: bool):
    """`kernel` compiled for `arch` with the constexprs its wrapper passes for `pdl` (in a process
    with KERNELS_COMPILE_ONLY=1, so that `launch_options` answers for `arch`)."""
    import importlib

    from kernels.matmul.offline import compile_triton

    module, pointers, floats, constants, num_warps = KERNELS[kernel]
    fn = getattr(importlib.import_module(f"kernels.decoder.{module}"), kernel)
    constants = constants | {"PDL": launch_options(pdl).get("PDL", False)}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return compile_triton(fn, signature, constants, arch, num_warps, num_stages=3)


def compile_offline(arch: str = "sm_90", kernels=tuple(KERNELS)) -> dict[tuple[str, bool], dict]:
    """{(kernel, pdl): {"wait", "launch_dependents", "target", ...}} for each kernel, compiled
    for `arch` in one fresh process."""
    variants = [{"kernel": k, "pdl": p} for k in kernels for p in (False, True)]
    made = run_compile_script(
        _SCRIPT, [json.dumps(variants), arch], f"compiling the decoder's kernels for {arch}", arch
    )
    return {(v["kernel"], v["pdl"]): m for v, m in zip(variants, made)}


def main() -> int:
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
    for (kernel, pdl), made in compile_offline(arch).items():
        print(
            f"{arch} {kernel:32} pdl={pdl!s:5}: {made['wait']} griddepcontrol.wait, "
            f"{made['launch_dependents']} launch_dependents ({made['target']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
