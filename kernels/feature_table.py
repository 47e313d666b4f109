"""Which kernel needs which GPU feature, and so where it cannot exist.

Every Triton and Gluon kernel the course launches is a row of KERNELS: the features one of its paths
uses beyond what every GPU the course serves has (`runtime.FEATURE_GPUS`), and what runs instead
where a feature is missing:

* a portable path (a string saying which): the kernel compiles for every architecture, with the
  feature switched off by the gate (`runtime.has`) that picks the path;
* None: the kernel cannot exist there; its wrapper runs another kernel or refuses with
  `runtime.FeatureMissing` before anything is compiled.

`tools/compile_all.py` compiles every row for every architecture of `runtime.COMPILE_ARCHS`, and
`tests/test_compile_all_archs.py` checks that the table names every kernel in `kernels/` and that
what it says cannot exist is never compiled. A Hopper instruction added to a kernel without a row
here (and a gate in its wrapper) fails that compile for sm_80.
"""

from __future__ import annotations

from kernels.runtime import COMPILE_ARCHS, FEATURE_GPUS, Features

PDL_OFF = "launched without programmatic dependent launch: the trigger compiled out"
FP8_BITS = "fp8 rounded in software and stored as its uint8 bit pattern"

# "module:kernel" (module under kernels/) -> (features a path of it uses, the portable path or None)
KERNELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "elementwise_add.triton_add:add_kernel": ((), None),
    "elementwise_add.triton_add:residual_add_kernel": ((), None),
    "profiling.transpose:transpose_naive_kernel": ((), None),
    "profiling.transpose:transpose_tiled_kernel": ((), None),
    "profiling.lab:_answer_kernel": ((), None),
    "rmsnorm.triton_rmsnorm:rmsnorm_fwd_kernel": (
        ("fp8",),
        "an fp8 input converted to float32 by PyTorch before the kernel",
    ),
    "rmsnorm.triton_rmsnorm:fused_add_rmsnorm_kernel": ((), None),
    "rmsnorm.triton_rmsnorm:rmsnorm_bwd_kernel": ((), None),
    "rmsnorm.triton_rmsnorm:sum_partials_kernel": ((), None),
    "matmul.triton_matmul:matmul_kernel": ((), None),
    "matmul.triton_matmul:matmul_persistent_kernel": ((), None),
    "matmul.triton_skinny:split_k_kernel": ((), None),
    "matmul.triton_skinny:sum_splits_kernel": ((), None),
    # matmul_tma refuses without TMA; the portable GEMM is triton_matmul.py
    "matmul.triton_matmul_tma:matmul_tma_kernel": (("tma",), None),
    # fp8_matmul refuses without fp8 tensor cores (sm_89+)
    "matmul.triton_fp8_matmul:fp8_matmul_kernel": (("fp8",), None),
    # gluon_matmul refuses anything but sm_90, before compiling
    "matmul.gluon_matmul:gluon_matmul_kernel": (("tma", "wgmma", "warp_specialization"), None),
    "rmsnorm.triton_pdl:matmul_kernel": (("pdl",), PDL_OFF),
    # without PDL, rms_norm_pdl runs triton_rmsnorm's plain kernel
    "rmsnorm.triton_pdl:rmsnorm_pdl_kernel": (("pdl",), None),
    "memory_profiling.triton_cross_entropy:_softmax_loss_grad_kernel": ((), None),
    "memory_profiling.triton_chunked_loss:_token_loss_kernel": ((), None),
    "mixed_precision.triton_reduce:sum_kernel": ((), None),
    "mixed_precision.triton_fp8:quantize_blocks_kernel": (("fp8",), FP8_BITS),
    "mixed_precision.triton_fp8:quantize_tensor_kernel": (("fp8",), FP8_BITS),
    "mixed_precision.triton_fp8:dequantize_kernel": (("fp8",), "fp8 decoded from its uint8 bits"),
    "mixed_precision.triton_fp8:fake_quantize_kernel": ((), None),
    "mixed_precision.triton_fp8:amax_kernel": ((), None),
    "flash_attention.triton_flash:flash_fwd_kernel": (
        ("tma",),
        "tiles loaded by pointers (TMA=False)",
    ),
    "flash_attention.triton_flash:flash_bwd_preprocess_kernel": ((), None),
    "flash_attention.triton_flash:flash_bwd_dkdv_kernel": ((), None),
    "flash_attention.triton_flash:flash_bwd_dq_kernel": ((), None),
    "flash_attention.triton_decode:flash_decode_split_kernel": ((), None),
    "flash_attention.triton_decode:flash_decode_combine_kernel": ((), None),
    # refused with FeatureMissing before compiling: the Triton kernels run everywhere else
    "flash_attention.gluon_flash:gluon_fwd_kernel": (("tma", "wgmma", "warp_specialization"), None),
    "flash_attention.gluon_flash_backward:gluon_bwd_kernel": (
        ("tma", "wgmma", "warp_specialization"),
        None,
    ),
    "moe.triton_permute:histogram_kernel": ((), None),
    "moe.triton_permute:scan_kernel": ((), None),
    "moe.triton_permute:place_kernel": ((), None),
    "moe.triton_router:router_kernel": ((), None),
    "moe.triton_combine:combine_kernel": ((), None),
    "moe.triton_grouped_gemm:grouped_gemm_kernel": ((), None),
    # without TMA, moe_forward picks the pointer grouped GEMM (triton_grouped_gemm)
    "moe.triton_grouped_gemm_tma:grouped_gemm_tma_kernel": (("tma",), None),
    "moe.triton_grouped_gemm_tma:gather_rows_kernel": ((), None),
    "decoder.triton_attention:cache_attention_split_kernel": ((), None),
    "decoder.triton_attention:cache_attention_combine_kernel": ((), None),
    "decoder.triton_ops:embedding_kernel": ((), None),
    "decoder.triton_ops:swiglu_kernel": ((), None),
    "decoder.triton_ops:argmax_chunk_kernel": ((), None),
    "decoder.triton_ops:argmax_final_kernel": ((), None),
    "decoder.triton_rope:rope_kernel": ((), None),
    "decoder.triton_rope:rope_append_kernel": ((), None),
    "decoder.triton_fused_gemv:add_norm_linear_kernel": ((), None),
    "decoder.triton_gemv:skinny_linear_kernel": ((), None),
    "decoder.triton_persistent_step:persistent_step_kernel": ((), None),
}

# Dtypes some GPUs cannot compute with. bf16: Turing (sm_75) has no bf16 tensor cores, so the
# course's products (tl.dot) refuse bf16 there and its kernels are compiled with fp16 instead;
# element-wise kernels convert bf16 in software and accept it.
DTYPE_FEATURES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def features_of(arch: str) -> Features:
    """The feature answers for an architecture name ("sm_80")."""
    major, minor = int(arch[3:-1]), int(arch[-1])
    return Features(arch, (major, minor), 0, 0)


def missing(kernel: str, arch: str) -> tuple[str, ...]:
    """The features `kernel`'s fast path uses that `arch` lacks."""
    found = features_of(arch)
    return tuple(f for f in KERNELS[kernel][0] if not found.has(f))


def cannot_exist(kernel: str) -> tuple[str, ...]:
    """The architectures of COMPILE_ARCHS where `kernel` is never compiled (no portable path)."""
    needs, portable = KERNELS[kernel]
    if portable is not None:
        return ()
    return tuple(arch for arch in COMPILE_ARCHS if missing(kernel, arch))


def check_table() -> None:
    """Every feature named is one runtime knows."""
    for kernel, (needs, _) in KERNELS.items():
        unknown = set(needs) - set(FEATURE_GPUS)
        if unknown:
            raise ValueError(f"{kernel}: unknown features {sorted(unknown)}")
