"""The warp-specialized Gluon forward (kernels/flash_attention/gluon_flash.py) against the float64
reference, on the same edge cases as the Triton kernel, and compiled for sm_90 without a GPU.

The CPU test compiles in a subprocess (`gluon_flash.compile_offline`): this process runs the Triton
interpreter (CPU mode), which cannot compile Gluon.
"""

import pytest
import torch

from tests.test_flash_attention import check_forward, make, run_forward


# On a GPU the kernel itself runs (tests below); the offline path uses the CPU environment's Triton.
@pytest.mark.cpu
@pytest.mark.parametrize(
    "head_dim, dtype, causal", [(128, "float16", True), (64, "bfloat16", False)]
)
def test_compiles_for_hopper_without_a_gpu(head_dim, dtype, causal):
    """The whole pipeline down to a cubin for sm_90: 12 warps (two consumer warpgroups and the
    producer's), wgmma for both products, TMA copies, register reallocation between the roles."""
    from kernels.flash_attention import gluon_flash

    made = gluon_flash.compile_offline(head_dim, dtype, causal)
    assert made["warps"] == 12 and made["wgmma"] > 0 and made["tma_copies"] > 0
    assert made["setmaxnreg"] > 0
    stages_kv = gluon_flash.STAGES * 2 * 128 * head_dim * 2  # K and V, 128 keys, 2 bytes
    assert made["shared_bytes"] >= stages_kv + 2 * 64 * head_dim * 2  # plus Q for both warpgroups


# (B, Hq, Hkv, Nq, Nk, D): odd lengths, cross attention, Nq > Nk (rows that see no key with causal),
# a few queries at the end of a long KV, GQA, one key.
GLUON_SHAPES = [
    (1, 2, 2, 197, 197, 64),
    (2, 4, 2, 300, 300, 128),
    (1, 2, 1, 130, 70, 64),
    (1, 2, 2, 3, 200, 128),
    (1, 2, 2, 1, 1, 64),
    (1, 4, 4, 256, 512, 128),
]


# (ping-pong turns, K/V stages, dtype): the default schedule in both dtypes, and the other two
# schedules the benchmark compares, in fp16.
VARIANTS = [(True, 3, torch.float16), (True, 3, torch.bfloat16), (False, 3, torch.float16),
            (True, 2, torch.float16)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: f"pingpong{int(v[0])}_stages{v[1]}_{v[2]}"
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=lambda s: "B{}_H{}:{}_Nq{}_Nk{}_D{}".format(*s))
def test_gluon_forward_matches_fp64(shape, causal, variant):
    from kernels.flash_attention import gluon_flash

    pingpong, stages, dtype = variant
    b, hq, hkv, nq, nk, d = shape
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq * 7 + nk + d)

    def forward(q, k, v, causal, *, out, lse):
        return gluon_flash.gluon_attention_forward(q, k, v, causal, out=out, lse=lse,
                                                   pingpong=pingpong, stages=stages)  # fmt: skip

    check_forward(*run_forward(forward, q, k, v, causal), q, k, v, causal)


@pytest.mark.gpu
def test_gluon_rejects_what_it_does_not_cover():
    from kernels.flash_attention import gluon_flash

    q, k, v = make((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, seed=1, layout="bnhd")
    with pytest.raises(ValueError, match="must be contiguous"):
        gluon_flash.gluon_attention_forward(q, k, v)
    q, k, v = make((1, 2, 64, 96), (1, 2, 64, 96), torch.float16, seed=2)
    with pytest.raises(ValueError, match="head_dim 96"):
        gluon_flash.gluon_attention_forward(q, k, v)
