"""The warp-specialized Gluon forward (kernels/flash_attention/gluon_flash.py) against the float64
reference, on the same edge cases as the Triton kernel, and compiled for sm_90 without a GPU.

The CPU test compiles in a subprocess (`gluon_offline.compile_offline_many`): this process runs
the Triton interpreter (CPU mode), which cannot compile Gluon.
"""

import pytest
import torch

from kernels import runtime
from tests.test_flash_attention import check_forward, make, run_forward

# Gluon kernels refuse off sm_90 (and under KERNELS_GPU_PROFILE=a100, say): what the refusal says
# is checked in tests/test_gpu_portability.py
needs_wgmma = pytest.mark.skipif(not runtime.has("wgmma"), reason="Gluon kernels need sm_90")

# On a GPU the kernel itself runs (tests below); the offline path uses the CPU environment's Triton.
# (head_dim, dtype, causal, schedule): the default schedule of each (head_dim, causal) (O stored
# by TMA in all four, causal tiles handed out by the host's plan; 3 warpgroups with the overlap,
# the turns and a ring of 2 at 64 non-causal; otherwise 2 warpgroups with the overlap (and the
# turns at 64 causal), a ring of 2 and two Q buffers on the persistent grid), O stored from
# registers, the snake, and the other combinations the GPU tests run: 2 warpgroups without the
# overlap, 3 warpgroups with and without turns, the overlap with turns, one CTA a tile at 128
# causal, one exponential in 4, 8 or 2 by the polynomial (at 3 warpgroups' 160 registers too),
# and two Q buffers on the persistent grid (at 128 with a ring of 2: with 3 the shared memory is
# full).
COMPILED = [(128, "float16", True, {}), (64, "bfloat16", False, {}), (64, "float16", True, {}),
            (128, "bfloat16", False, {"overlap": False}),
            (64, "float16", True, {"warpgroups": 3, "overlap": False}),
            (64, "bfloat16", False, {"warpgroups": 3, "pingpong": False}),
            (128, "float16", False, {"overlap": True, "pingpong": True}),
            (64, "float16", False, {"warpgroups": 2, "overlap": True}),
            (128, "float16", True, {"persistent": False, "overlap": True}),
            (64, "float16", False, {"poly_exp2": 4}), (64, "bfloat16", True, {"poly_exp2": 8}),
            (128, "float16", False, {"poly_exp2": 2}), (64, "float16", False, {"tma_store": False}),
            (128, "float16", True, {"tma_store": False}),
            (64, "bfloat16", True, {"tile_plan": False}),
            (128, "bfloat16", False, {"persistent": False}),
            (64, "float16", False, {"warpgroups": 2, "persistent": True, "overlap": False,
                                    "q_buffers": 2})]  # fmt: skip


def test_every_default_schedule_is_one_the_kernel_has():
    """DEFAULT_SCHEDULE is read for every call without keywords: an entry the checks refuse (3
    warpgroups at 128, or with the persistent grid) would break every such call."""
    from kernels.flash_attention import gluon_flash

    for (head_dim, causal), schedule in gluon_flash.DEFAULT_SCHEDULE.items():
        resolved = gluon_flash.resolve_schedule(head_dim, causal)
        assert resolved["PINGPONG"] == schedule["pingpong"]
        assert resolved["STAGES"] == schedule["stages"]
        assert resolved["NUM_WG"] == schedule["warpgroups"]
        assert resolved["OVERLAP"] == schedule["overlap"]
        assert bool(resolved["PERSISTENT"]) == schedule["persistent"]
        assert (resolved["PERSISTENT"] == 2) == schedule["tile_plan"]  # 2: the host's plan
        assert resolved["POLY_EXP2"] == schedule["poly_exp2"]
        assert resolved["Q_BUFFERS"] == schedule["q_buffers"]
        assert resolved["TMA_STORE"] == schedule["tma_store"]
    assert set(gluon_flash.DEFAULT_SCHEDULE) == {(d, c) for d in gluon_flash.HEAD_DIMS
                                                  for c in (False, True)}  # fmt: skip
    with pytest.raises(ValueError, match="warpgroups=3 needs head_dim 64"):
        gluon_flash.resolve_schedule(128, False, warpgroups=3)
    # At 64 causal the default grid is persistent, which 3 warpgroups do not have: asking for 3
    # warpgroups alone gets the grid of one CTA per tile (an H200 run refused it before)
    assert gluon_flash.DEFAULT_SCHEDULE[64, True]["persistent"]
    assert not gluon_flash.resolve_schedule(64, True, warpgroups=3)["PERSISTENT"]
    with pytest.raises(ValueError, match="persistent=True needs 2 warpgroups"):
        gluon_flash.resolve_schedule(64, True, warpgroups=3, persistent=True)
    with pytest.raises(ValueError, match="poly_exp2 3; supported: 0"):
        gluon_flash.resolve_schedule(64, False, poly_exp2=3)
    with pytest.raises(ValueError, match="q_buffers 3; supported: 1, 2"):
        gluon_flash.resolve_schedule(64, True, q_buffers=3)
    with pytest.raises(ValueError, match="q_buffers=2 needs persistent=True"):
        gluon_flash.resolve_schedule(64, True, q_buffers=2, persistent=False)
    # Q 2 x 2 x 16 KiB + 3 x (K + V) 64 KiB = 256 KiB at 128: no room for a second Q buffer
    with pytest.raises(ValueError, match="need 256 KiB of shared memory, more than the 227"):
        gluon_flash.resolve_schedule(128, True, stages=3, q_buffers=2)
    assert gluon_flash.resolve_schedule(128, True, stages=2, q_buffers=2)["Q_BUFFERS"] == 2
    # O's TMA copy is staged in the tile's Q buffer, released a block into the next tile: on the
    # persistent grid one buffer would deadlock, so a default second buffer and TMA store give
    # way to an explicit ring of 3 at 128 (no room) or to no overlap (that consumer has no copy).
    assert gluon_flash.DEFAULT_SCHEDULE[128, True]["tma_store"]
    three = gluon_flash.resolve_schedule(128, True, stages=3)
    assert (three["Q_BUFFERS"], three["TMA_STORE"], three["PERSISTENT"]) == (1, False, 2)
    assert not gluon_flash.resolve_schedule(64, True, overlap=False)["TMA_STORE"]
    with pytest.raises(ValueError, match="tma_store=True needs overlap=True"):
        gluon_flash.resolve_schedule(64, True, q_buffers=1, tma_store=True)
    with pytest.raises(ValueError, match="tma_store=True needs overlap=True"):
        gluon_flash.resolve_schedule(128, False, overlap=False, tma_store=True)
    assert gluon_flash.resolve_schedule(64, True, persistent=False, tma_store=True)["TMA_STORE"]
    with pytest.raises(ValueError, match="tile_plan=True needs persistent=True"):
        gluon_flash.resolve_schedule(64, False, tile_plan=True)
    assert gluon_flash.resolve_schedule(64, True, tile_plan=True)["PERSISTENT"] == 2


@pytest.mark.cpu
def test_a_tensor_off_a_16_byte_boundary_is_refused_by_name():
    """TMA copies (Q, K, V in, O out) need 16-byte aligned tensors: a view that starts one element
    in gets a ValueError naming it, not an assertion from inside the descriptor."""
    from kernels.flash_attention import gluon_flash

    whole = torch.randn(2 * 64 + 1, dtype=torch.float16)
    gluon_flash.check_tma_tensors("gluon_attention_forward", out=whole[:128])
    with pytest.raises(ValueError, match="out must start on a 16-byte boundary"):
        gluon_flash.check_tma_tensors("gluon_attention_forward", out=whole[1:])


@pytest.mark.cpu
def test_the_tile_plan_runs_every_tile_once_and_balances_causal_work():
    """The persistent grid's plan (`plan_tiles`): every tile exactly once, and at the D 64 causal
    target (16 query tiles of 128 rows a head, 256 heads, 132 CTAs) the busiest CTA within 1% of
    the mean where the snake leaves it 3% above; where no window does better (few heads), the
    snake itself."""
    from kernels.flash_attention import gluon_flash

    def loads(plan, cost):
        return [sum(cost[t] for t in tiles) for tiles in plan]

    shape = (16, 256, 2048, 2048, 128)  # query tiles a head, heads, Nq, Nk, rows a tile
    cost = [blocks + 1 for blocks in gluon_flash.tile_blocks(*shape, causal=True)]
    assert cost[:3] == [17, 16, 15] and len(cost) == 16 * 256  # the last query tile first
    plan, how = gluon_flash.plan_tiles(*shape, causal=True, ctas=132, max_window=32)
    assert sorted(t for tiles in plan for t in tiles) == list(range(len(cost)))
    snake, _ = gluon_flash.plan_tiles(*shape, causal=True, ctas=132, max_window=0)
    mean = sum(cost) / 132
    assert max(loads(snake, cost)) > 1.03 * mean
    assert max(loads(plan, cost)) < 1.01 * mean, how
    assert how.startswith("longest first in windows of")
    # A window may not hold more heads than max_window (their K and V would leave the L2)
    assert int(how.split()[-2]) <= 32
    few, how = gluon_flash.plan_tiles(16, 8, 2048, 2048, 128, causal=True, ctas=132, max_window=32)
    assert how == "snake" and sorted(t for tiles in few for t in tiles) == list(range(16 * 8))
    # Without a mask every tile costs the same: the plan is the snake's round robin
    _, how = gluon_flash.plan_tiles(16, 256, 2048, 2048, 128, causal=False, ctas=132,
                                    max_window=32)  # fmt: skip
    assert how == "snake"


def test_the_polynomial_exponential_is_within_its_stated_error():
    """`poly_exp2` computes some exponentials as 2^round(x) * EXP2_POLY(f): the polynomial, run in
    float32 as the PTX runs it (Horner, fused multiply-adds), is within 2.7e-6 of 2^f relative on
    [-0.5, 0.5], which keeps the log-sum-exp within its float32 check; the PTX carries exactly
    those coefficients, and one exponential in every n leaves the multi-function unit."""
    import re
    import struct

    import numpy as np

    from kernels.flash_attention import gluon_flash

    f = np.linspace(-0.5, 0.5, 100001, dtype=np.float32)
    coefficients = np.float32(gluon_flash.EXP2_POLY)
    p = np.full_like(f, coefficients[0])
    for c in coefficients[1:]:
        p = (p.astype(np.float64) * f + c).astype(np.float32)  # one rounding, as fma.rn
    relative = np.abs(p / np.exp2(f.astype(np.float64)) - 1)
    assert relative.max() < 2.7e-6
    assert relative.max() > 1e-7  # a degree-4 fit: exact would mean the check evaluated 2^f
    for n, asm in gluon_flash.EXP2_ASM.items():
        assert asm.count("ex2.approx") == n - 1
        floats = [
            struct.unpack(">f", bytes.fromhex(h))[0] for h in re.findall(r"0f([0-9A-F]{8})", asm)
        ]
        assert floats[0] == -126.0 and floats[1] == floats[2] == 1.5 * 2**23
        assert np.array_equal(np.float32(floats[3:]), coefficients)
        assert f"${2 * n - 1}" in asm and f"mov.b32 ${n - 1}, pb;" in asm  # last input, last output


@pytest.fixture(scope="module")
def compiled_offline():
    """Every COMPILED variant, compiled in one process (torch and Triton imported once)."""
    from kernels.flash_attention import gluon_offline

    return gluon_offline.compile_offline_many(COMPILED, "kernels.flash_attention.gluon_flash")


@pytest.mark.cpu
@pytest.mark.parametrize("variant", range(len(COMPILED)),
                         ids=lambda i: str(COMPILED[i]).replace(" ", ""))  # fmt: skip
def test_compiles_for_hopper_without_a_gpu(compiled_offline, variant):
    """The whole pipeline down to a cubin for sm_90: one consumer warpgroup per 64 query rows plus
    the producer's (padded to a warpgroup), wgmma for both products, TMA copies, register
    reallocation between the roles within the SM's 65,536 registers, shared memory within the
    227 KiB a CTA may have, and nothing spilled to local memory."""
    from kernels.flash_attention import gluon_flash

    head_dim, _, causal, schedule = COMPILED[variant]
    assert len(compiled_offline) == len(COMPILED)
    made = compiled_offline[variant]
    resolved = gluon_flash.resolve_schedule(head_dim, causal, **schedule)
    n_wg = resolved["NUM_WG"]
    assert made["warps"] == 4 * (n_wg + 1)
    assert made["wgmma"] > 0 and made["tma_copies"] > 0
    consumer, producer = gluon_flash.CONSUMER_REGS[n_wg], gluon_flash.PRODUCER_REGS
    assert {consumer, producer} <= set(made["register_budgets"])
    assert 128 * (n_wg * consumer + producer) <= 65536
    # Three warpgroups (160 registers a thread) with O's TMA copy spill 416 bytes (ptxas, offline)
    # and still ran 2.6 points of cuDNN faster than without the copy (H200, PERFORMANCE.md);
    # every other schedule spills nothing.
    spill_allowed = 512 if n_wg == 3 and resolved["TMA_STORE"] else 0
    assert made["spill_bytes"] <= spill_allowed, made
    stages_kv = resolved["STAGES"] * 2 * 128 * head_dim * 2  # K and V, 128 keys, 2 bytes
    q_bytes = resolved["Q_BUFFERS"] * n_wg * 64 * head_dim * 2  # Q per buffer and warpgroup
    assert made["shared_bytes"] >= stages_kv + q_bytes
    assert made["shared_bytes"] <= 227 * 1024


# (B, Hq, Hkv, Nq, Nk, D): odd lengths, cross attention, Nq > Nk (rows that see no key with causal),
# a few queries at the end of a long KV, GQA, one key.
GLUON_SHAPES = [
    (1, 2, 2, 197, 197, 64),
    (2, 4, 2, 300, 300, 128),
    (1, 2, 1, 130, 70, 64),
    (1, 2, 2, 3, 200, 128),
    (1, 2, 2, 1, 1, 64),
    (1, 4, 4, 256, 512, 128),
    (2, 4, 2, 700, 700, 64),  # 6 key blocks: the ring of 3 slots wraps twice at D = 64
    # More tiles than an H100 or H200 has SMs (132): a persistent CTA takes 2 to 4 tiles, one a
    # round, every other round in reverse order (the snake), and the ring's position, the turns
    # and Q's barrier run on across them. 5 x 32 = 160 tiles, and with causal and Nq > Nk the
    # first tile of each head sees no key.
    (2, 16, 8, 600, 200, 64),
    (4, 16, 4, 1000, 1000, 128),  # 8 x 64 = 512 tiles: the last, partial round runs backwards
    (2, 16, 4, 1100, 1100, 64),  # 9 x 32 = 288 tiles: the last, partial round runs forwards
]


# Two Q buffers need the persistent grid, and at D = 128 a ring of 2 for the shared memory.
TWO_Q_BUFFERS = {"warpgroups": 2, "overlap": True, "persistent": True, "stages": 2, "q_buffers": 2}
# (schedule, dtype): the default schedule of each case in both dtypes, the default with and without
# its turns and with 2 and 3 stages (the benchmark's comparisons), and every combination of
# warpgroups, overlap and persistent grid (with the case's turns and ring unless named), in fp16,
# most also in bf16 or without turns; and the polynomial exponentials, one in 4 in both dtypes,
# one in 8 (the benchmark's) and one in 2, and one in 4 without the overlap (`_consumer`); two Q
# buffers on the persistent grid in both dtypes, and without the overlap; O stored from registers
# in both dtypes, and by TMA with the turns on one CTA a tile; the host's tile plan without a mask,
# and the snake with one.
VARIANTS = [({}, torch.float16), ({}, torch.bfloat16), ({"pingpong": False}, torch.float16),
            ({"pingpong": True}, torch.float16), ({"stages": 2}, torch.float16),
            ({"stages": 3}, torch.float16),
            ({"warpgroups": 2, "overlap": False, "persistent": False}, torch.float16),
            ({"warpgroups": 2, "overlap": False, "persistent": False}, torch.bfloat16),
            ({"warpgroups": 3, "overlap": False}, torch.float16),
            ({"warpgroups": 3, "overlap": False}, torch.bfloat16),
            ({"warpgroups": 3, "overlap": False, "pingpong": False}, torch.float16),
            ({"warpgroups": 2, "overlap": True, "persistent": False}, torch.float16),
            ({"warpgroups": 2, "overlap": True, "persistent": False}, torch.bfloat16),
            ({"warpgroups": 2, "overlap": True, "persistent": False, "pingpong": False},
             torch.float16),
            ({"warpgroups": 3, "overlap": True}, torch.float16),
            ({"warpgroups": 2, "persistent": True, "overlap": False}, torch.float16),
            ({"warpgroups": 2, "persistent": True, "overlap": False}, torch.bfloat16),
            ({"warpgroups": 2, "persistent": True, "overlap": True}, torch.float16),
            ({"warpgroups": 2, "persistent": True, "overlap": False, "pingpong": False},
             torch.float16),
            ({"poly_exp2": 4}, torch.float16), ({"poly_exp2": 4}, torch.bfloat16),
            ({"poly_exp2": 8}, torch.float16), ({"poly_exp2": 2}, torch.bfloat16),
            ({"poly_exp2": 4, "warpgroups": 2, "overlap": False, "persistent": False},
             torch.float16),
            (TWO_Q_BUFFERS, torch.float16), (TWO_Q_BUFFERS, torch.bfloat16),
            ({**TWO_Q_BUFFERS, "overlap": False}, torch.float16),
            ({"tma_store": False}, torch.float16), ({"tma_store": False}, torch.bfloat16),
            ({"pingpong": True, "persistent": False}, torch.float16),
            ({**TWO_Q_BUFFERS, "tile_plan": True}, torch.float16),
            ({"tile_plan": False}, torch.bfloat16)]  # fmt: skip


def _variant_id(variant):
    schedule, dtype = variant
    names = [f"{k}{int(v)}" for k, v in schedule.items()] or ["default"]
    return "_".join(names + [str(dtype).removeprefix("torch.")])


def _shape_id(shape):
    return "B{}_H{}:{}_Nq{}_Nk{}_D{}".format(*shape)


# Every shape with every variant it covers: 3 consumer warpgroups take head_dim 64 only (the
# rejection of 128 is tested below), so those pairs are not generated rather than skipped.
SHAPE_VARIANTS = [
    pytest.param(shape, variant, id=f"{_shape_id(shape)}-{_variant_id(variant)}")
    for shape in GLUON_SHAPES
    for variant in VARIANTS
    if variant[0].get("warpgroups", 2) != 3 or shape[5] == 64
]


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape, variant", SHAPE_VARIANTS)
def test_gluon_forward_matches_fp64(shape, causal, variant):
    from kernels.flash_attention import gluon_flash

    schedule, dtype = variant
    b, hq, hkv, nq, nk, d = shape
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq * 7 + nk + d)

    def forward(q, k, v, causal, *, out, lse):
        return gluon_flash.gluon_attention_forward(q, k, v, causal, out=out, lse=lse, **schedule)

    check_forward(*run_forward(forward, q, k, v, causal), q, k, v, causal)


@pytest.mark.gpu
@needs_wgmma
def test_gluon_rejects_what_it_does_not_cover():
    from kernels.flash_attention import gluon_flash

    q, k, v = make((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, seed=1, layout="bnhd")
    with pytest.raises(ValueError, match="must be contiguous"):
        gluon_flash.gluon_attention_forward(q, k, v)
    q, k, v = make((1, 2, 64, 96), (1, 2, 64, 96), torch.float16, seed=2)
    with pytest.raises(ValueError, match="head_dim 96"):
        gluon_flash.gluon_attention_forward(q, k, v)
    q, k, v = make((1, 2, 64, 128), (1, 2, 64, 128), torch.float16, seed=3)
    with pytest.raises(ValueError, match="warpgroups=3 needs head_dim 64"):
        gluon_flash.gluon_attention_forward(q, k, v, warpgroups=3)
    q, k, v = make((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, seed=4)
    with pytest.raises(ValueError, match="persistent=True needs 2 warpgroups"):
        gluon_flash.gluon_attention_forward(q, k, v, warpgroups=3, persistent=True)


def test_gluon_targets_state_the_ratio_and_its_threshold():
    """The targets table once printed Gluon / cuDNN divided by the threshold next to a threshold
    of 1.0: 0.945x at D = 128 read as 0.994 against ">= 0.95 x cuDNN". It states the ratio now."""
    from kernels.flash_attention import benchmark_gluon

    def row(shape, ratio):
        impls = {"ours (Gluon)": {"fwd_vs_cudnn": ratio}}
        return {"shape": shape, "dtype": "float16", "causal": False, "impls": impls}

    rows = [row([32, 32, 4096, 128], 0.945), row([16, 16, 2048, 64], 1.01)]
    checks = benchmark_gluon.targets(rows)
    got = [(c["target"], c["value"], c["threshold"], c["pass"]) for c in checks]
    assert got == [
        ("fwd (32, 32, 4096, 128) float16: Gluon >= 0.95 x cuDNN", 0.945, 0.95, False),
        ("fwd (16, 16, 2048, 64) float16: Gluon >= 1.0 x cuDNN", 1.01, 1.0, True),
    ]


def test_the_flash_attn_cute_comparison_says_what_to_install(monkeypatch):
    """The benchmark that times FlashAttention's CuTe DSL kernels beside the course's needs
    a package the course does not install: without it the benchmark stops before touching a GPU and
    names the pinned install line, and the committed run it would write records those versions."""
    import json
    import sys

    from kernels.bench import RESULTS_DIR
    from kernels.flash_attention import benchmark, benchmark_flash_attn_cute

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed: the import fails
    with pytest.raises(RuntimeError, match=r"pip install flash-attn-4==4\.0\.0b36 "):
        benchmark_flash_attn_cute.flash_attn_cute_reference()
    path = RESULTS_DIR / "h100-80gb-hbm3" / "03_flash_attention_flash_attn_cute.json"
    saved = json.loads(path.read_text())["flash_attn_cute"]
    pins = dict(pin.split("==") for pin in benchmark_flash_attn_cute.FLASH_ATTN_CUTE_PINS.split())
    assert saved["versions"]["flash-attn-4"] == pins["flash-attn-4"]
    assert saved["versions"]["nvidia-cutlass-dsl"] == pins["nvidia-cutlass-dsl[cu13]"]
    cases = {(tuple(r["shape"]), r["dtype"], r["causal"]) for r in saved["forward"]}
    assert cases == {(shape, dtype, causal) for shape in benchmark.TARGET_SHAPES
                     for dtype in ("float16", "bfloat16") for causal in (False, True)}  # fmt: skip
