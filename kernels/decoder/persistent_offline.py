"""The persistent decode step compiled for a GPU this machine may not have, from the arguments its
wrapper would launch with.

A persistent kernel is only safe when every program is resident at once: a program that is not
running cannot arrive on a counter, and the others wait for it (the watchdog then stops them, but
the step is lost). Whether P programs fit is a question of the compiled kernel's registers and
shared memory, so it can be answered without a GPU:

    KERNELS_COMPILE_ONLY=1 python -m kernels.decoder.persistent_offline

compiles the launch configurations the wrapper and its benchmark use, for sm_90, and prints for
each the registers a thread, the bytes spilled and the programs an SM can hold
(tests/test_decoder_persistent.py checks them through kernels.matmul.offline.compile_offline, in a
process of its own).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from kernels import runtime
from kernels.decoder.config import LLAMA_1B, TINY
from kernels.decoder.triton_persistent_step import PersistentStep, persistent_step_kernel

CONFIGS = {"tiny": TINY, "1b": LLAMA_1B}
REGISTERS_PER_SM = 65536
# (config, dtype, batch, options): the GPU tests' and the benchmark's launches
VARIANTS = [
    ("tiny", "float32", 1, {}),
    ("tiny", "bfloat16", 2, {}),
    ("tiny", "float32", 8, {}),
    ("tiny", "bfloat16", 8, {}),
    ("1b", "bfloat16", 1, {}),
    ("1b", "bfloat16", 1, {"programs_per_sm": 2, "num_warps": 4}),
    ("1b", "bfloat16", 1, {"trace": True}),
    ("1b", "bfloat16", 8, {}),
    ("1b", "bfloat16", 8, {"num_stages": 3}),
    ("1b", "bfloat16", 32, {}),
    # the GEMV phases' K tiles pipelined through shared memory (PERFORMANCE.md 6.2)
    ("1b", "bfloat16", 1, {"pipelined_k": 512, "pipeline_stages": 5}),
    ("1b", "bfloat16", 1, {"pipelined_k": 1024, "pipeline_stages": 3}),
    ("1b", "bfloat16", 1, {"pipelined_k": 256, "pipeline_stages": 8}),
    ("1b", "bfloat16", 8, {"pipelined_k": 256, "pipeline_stages": 5}),
    # ... with the product summed over K once a unit (PERFORMANCE.md 6.3): its register tile is
    # batch x 8 rows x K tile fp32 over 256 threads, 32 a thread in each of the last three
    ("1b", "bfloat16", 1, {"pipelined_k": 1024, "pipeline_stages": 3, "defer_reduce": True}),
    ("1b", "bfloat16", 1, {"pipelined_k": 512, "pipeline_stages": 5, "defer_reduce": True}),
    ("1b", "bfloat16", 2, {"pipelined_k": 512, "pipeline_stages": 5, "defer_reduce": True}),
    ("1b", "bfloat16", 4, {"pipelined_k": 256, "pipeline_stages": 8, "defer_reduce": True}),
    # ... and the qkv phase in the same loop, RoPE and the cache append its epilogue (6.4)
    (
        "1b",
        "bfloat16",
        1,
        {"pipelined_k": 1024, "pipeline_stages": 3, "defer_reduce": True, "pipelined_qkv": True},
    ),
    (
        "1b",
        "bfloat16",
        2,
        {"pipelined_k": 512, "pipeline_stages": 5, "defer_reduce": True, "pipelined_qkv": True},
    ),
    ("1b", "bfloat16", 8, {"pipelined_k": 256, "pipeline_stages": 5, "pipelined_qkv": True}),
    # ... and the attention phase's products on the tensor cores (6.5)
    ("tiny", "float32", 2, {"attention_dot": True}),
    ("tiny", "bfloat16", 1, {"attention_dot": True}),
    (
        "1b",
        "bfloat16",
        1,
        {
            "pipelined_k": 1024,
            "pipeline_stages": 3,
            "defer_reduce": True,
            "pipelined_qkv": True,
            "attention_dot": True,
        },
    ),
    ("1b", "bfloat16", 8, {"pipelined_k": 256, "pipeline_stages": 5, "attention_dot": True}),
]
TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
}


def shell_model(config, dtype: torch.dtype, batch: int, capacity: int = 64):
    """What PersistentStep reads of a Decoder, with weights that take no memory (expanded zeros:
    the compile needs their dtypes, not their values)."""

    def weight(*shape, dt=dtype):
        return torch.zeros((), dtype=dt).expand(*shape)

    c, n = config, config.n_layers
    stacks = {
        "qkv": weight(n, c.qkv_width, c.hidden_size),
        "o": weight(n, c.hidden_size, c.n_heads * c.head_dim),
        "gate_up": weight(n, 2 * c.intermediate_size, c.hidden_size),
        "down": weight(n, c.hidden_size, c.intermediate_size),
        "attn_norm": weight(n, c.hidden_size),
        "mlp_norm": weight(n, c.hidden_size),
    }
    embed = weight(c.vocab_size, c.hidden_size)
    w = SimpleNamespace(
        embed=embed,
        lm_head=embed,
        norm=weight(c.hidden_size),
        inv_freq=weight(c.head_dim // 2, dt=torch.float32),
        rope_scale=1.0,
        stacks=stacks,
    )
    kv = weight(n, batch, c.n_kv_heads, capacity, c.head_dim)
    cache = SimpleNamespace(k=kv, v=kv, batch=batch, capacity=capacity)
    return SimpleNamespace(
        c=c, dtype=dtype, device=torch.device("cpu"), max_batch=batch, w=w, cache=cache,
        scale=c.head_dim**-0.5,
    )  # fmt: skip


def compile_for(
    arch: str,
    config: str = "1b",
    dtype: str = "bfloat16",
    batch: int = 1,
    programs_per_sm: int = 1,
    **options,
):
    """The kernel compiled for `arch` as PersistentStep would launch it (KERNELS_COMPILE_ONLY=1)."""
    from kernels.matmul.offline import compile_triton

    model = shell_model(CONFIGS[config], getattr(torch, dtype), batch)
    programs = programs_per_sm * runtime.features().sm_count
    step = PersistentStep(model, batch, programs=programs, **options)
    args, constants = step.kernel_arguments()
    signature, divisible = {}, []
    for name, value in zip(persistent_step_kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            divisible.append(name)  # the caching allocator's tensors are 16-byte aligned
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
            if isinstance(value, int) and value % 16 == 0:
                divisible.append(name)
    signature |= dict.fromkeys(constants, "constexpr")
    return compile_triton(
        persistent_step_kernel,
        signature,
        constants,
        arch,
        step.num_warps,
        step.num_stages,
        divisible=tuple(divisible),
    )


def programs_per_sm_that_fit(registers: int, warps: int) -> int:
    """Programs an SM holds by registers (allocated per warp, in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    return REGISTERS_PER_SM // (per_warp * warps)


def main() -> int:
    from kernels.matmul.offline import compile_offline

    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
    variants = [{"config": c, "dtype": d, "batch": b, **o} for c, d, b, o in VARIANTS]
    for options, made in zip(
        variants, compile_offline("kernels.decoder.persistent_offline", variants, arch)
    ):
        fit = programs_per_sm_that_fit(made["registers"], made["warps"])
        print(
            f"{options}: {made['registers']} registers, {made['spill_bytes']} bytes spilled, "
            f"{made['shared_bytes']} bytes shared, {made['async_copies']} cp.async, "
            f"{fit} programs fit an SM "
            f"({options.get('programs_per_sm', 1)} launched)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
