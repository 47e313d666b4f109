"""Attention kernels against the float64 reference: FlashAttention-2 forward (odd lengths, Nq != Nk,
bottom-right causal, GQA, head dims, fp16/bf16, strided inputs, lse), backward (gradients against
fp64 autograd), flash-decoding, and the error messages.

Tolerances. The kernels compute q.k and the sums in float32 from exact products, so what is left is
rounding to the input dtype: P is rounded before the P V product (as in FlashAttention), the output
once more. Each is half an ulp relative to the *terms* it touches, not to the result, so the bound
is stated against the magnitude of the terms, P |V| (a row of O can cancel to near 0 while its terms
do not):
    |O - O_ref| <= 2 ulp * (P |V|)          (one ulp each for P and O: the interpreter truncates
    bf16)
The gradients go through more roundings (P and dS to the dtype, delta from the rounded O) and dS = P
(dP - delta) cancels, so the same idea uses |dS| <= P (|dP| + |delta|) as the term magnitude, with 4
ulp. lse is float32 throughout: a few float32 ulps of its terms, bounded generously by 2^-16
absolute. Outputs are written into NaN-poisoned buffers, so an element the kernel forgot fails.
"""

import math

import pytest
import torch

from kernels import runtime
from kernels.flash_attention import reference, triton_decode, triton_flash
from kernels.flash_attention.validate import check_attention_inputs
from kernels.testing import TINY, ULP, compare, generator, poison_, random_tensor

DEVICE = runtime.DEVICE


@pytest.fixture(autouse=True, scope="module")
def one_config_per_case():
    """On a GPU, autotuning every case would compile 4-5 kernels per (head dim, causal, dtype): pin
    the first table entry (test_every_tuned_config covers the others). CPU mode has one config
    anyway."""
    saved = triton_flash.TUNING_OVERRIDE
    triton_flash.TUNING_OVERRIDE = 0
    triton_flash.reset_autotuning()
    yield
    triton_flash.TUNING_OVERRIDE = saved
    triton_flash.reset_autotuning()


DTYPES = [torch.float16, torch.bfloat16]
LSE_ATOL = 2.0**-16


def make(shape_q, shape_kv, dtype, seed, layout="bhnd"):
    """Fresh standard-normal q, k, v. layout="bnhd" builds (B, N, H, D) tensors and transposes them
    to (B, H, N, D): strided in seq and heads, last dimension contiguous."""
    g = generator(seed, DEVICE)

    def one(shape):
        if layout == "bnhd":
            b, h, n, d = shape
            return random_tensor((b, n, h, d), dtype, DEVICE, g).transpose(1, 2)
        return random_tensor(shape, dtype, DEVICE, g)

    return one(shape_q), one(shape_kv), one(shape_kv)


def probabilities(q, k, causal, scale=None):
    """P in float64 (B, Hq, Nq, Nk), with k expanded over the query heads of each group."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k64 = reference._expand_kv(k.double(), q.shape[1])
    s = q.double() @ k64.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


def check_forward(out, lse, q, k, v, causal, scale=None):
    want, want_lse = reference.attention_fp64(q, k, v, causal=causal, scale=scale)
    magnitude = probabilities(q, k, causal, scale) @ reference._expand_kv(
        v.double().abs(), q.shape[1]
    )
    cmp = compare(out, want, atol=TINY[q.dtype], rtol=2 * ULP[q.dtype], scale=magnitude)
    assert cmp.ok, "out: " + cmp.reason
    assert lse.dtype == torch.float32
    # rows that see no key: lse is -inf in both; elsewhere within float32 rounding
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "lse: -inf in the wrong rows"
    finite = torch.isfinite(want_lse)
    cmp = compare(lse[finite], want_lse[finite], atol=LSE_ATOL, rtol=2.0**-20)
    assert cmp.ok, "lse: " + cmp.reason


def run_forward(fn, q, k, v, causal, **kw):
    out = poison_(torch.empty(q.shape, dtype=q.dtype, device=q.device))
    lse = poison_(torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))
    fn(q, k, v, causal, out=out, lse=lse, **kw)
    return out, lse


def flash_forward(q, k, v, causal, *, out, lse, **kw):
    return triton_flash.flash_attention_forward(q, k, v, causal, out=out, lse=lse, **kw)


def decode_forward(q, k, v, causal, *, out, lse, **kw):
    return triton_decode.flash_decode(q, k, v, causal, out=out, lse=lse, **kw)


# (B, Hq, Hkv, Nq, Nk, D): lengths 1, 100, 197 (not multiples of any block), cross attention (Nq !=
# Nk), a few queries at the end of a long KV (decode-style causal), Nq > Nk (causal rows that see no
# key), GQA 4:2, head dims 32, 64, 128.
FORWARD_SHAPES = [
    (1, 2, 2, 1, 1, 64),
    (1, 2, 2, 100, 100, 64),
    (1, 2, 2, 197, 197, 32),
    (1, 1, 1, 197, 197, 128),
    (2, 4, 2, 100, 100, 64),
    (1, 2, 2, 70, 150, 64),
    (1, 4, 2, 3, 200, 64),
    (1, 2, 1, 130, 70, 32),
    (
        1,
        runtime.pick(gpu=16, cpu=4),
        2,
        150,
        150,
        128,
    ),  # Qwen2's 16:2 grouping; 4:2 on the CPU
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", FORWARD_SHAPES, ids=lambda s: "B{}_H{}:{}_Nq{}_Nk{}_D{}".format(*s)
)
def test_forward_matches_fp64(shape, causal, dtype):
    b, hq, hkv, nq, nk, d = shape
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq * 7 + nk + d)
    check_forward(*run_forward(flash_forward, q, k, v, causal), q, k, v, causal)


# Head sizes that are not powers of two (the kernels pad the tile to the next one and mask the
# rest): 8 (below the smallest tl.dot), 24, 80 (Phi-2), 96 (Phi-3-mini), 192 (DeepSeek-V2's q/k),
# 200.
ODD_HEAD_DIMS = [8, 24, 80, 96, 192, 200]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", ODD_HEAD_DIMS)
def test_forward_padded_head_dims(head_dim, causal, dtype):
    """Odd lengths, GQA 4:2, a (B, N, H, D) layout (strided in seq and heads)."""
    q, k, v = make((1, 4, 37, head_dim), (1, 2, 53, head_dim), dtype, seed=head_dim, layout="bnhd")
    check_forward(*run_forward(flash_forward, q, k, v, causal), q, k, v, causal)


# tma=True is refused where TMA does not exist (KERNELS_GPU_PROFILE=a100 on an H200, say)
needs_tma = pytest.mark.skipif(not runtime.has("tma"), reason="this GPU (or profile) has no TMA")


@needs_tma
def test_forward_padded_head_dim_through_tma_descriptors():
    q, k, v = make((1, 2, 45, 80), (1, 1, 70, 80), torch.bfloat16, seed=80, layout="bnhd")
    check_forward(*run_forward(flash_forward, q, k, v, True, tma=True), q, k, v, True)


def test_forward_long_sequence_and_head_dim_256():
    q, k, v = make((1, 1, 1000, 64), (1, 1, 1000, 64), torch.float16, seed=1)
    check_forward(*run_forward(flash_forward, q, k, v, True), q, k, v, True)
    q, k, v = make((1, 1, 50, 256), (1, 1, 90, 256), torch.bfloat16, seed=2)
    check_forward(*run_forward(flash_forward, q, k, v, False), q, k, v, False)


@needs_tma
def test_forward_through_tma_descriptors():
    """The forward's other load path (tensor descriptors: TMA on Hopper), on the edges the copy
    engine clips: Nq and Nk not multiples of the blocks, causal with Nq > Nk, GQA, a (B, N, H, D)
    layout."""
    for (b, hq, hkv, nq, nk, d), causal, dtype in [
        ((1, 2, 2, 197, 197, 64), True, torch.bfloat16),
        ((1, 4, 2, 130, 70, 32), True, torch.float16),
        ((2, 2, 1, 33, 150, 128), False, torch.float16),
    ]:
        q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq + nk, layout="bnhd")
        check_forward(*run_forward(flash_forward, q, k, v, causal, tma=True), q, k, v, causal)
    buf = random_tensor((1, 2, 8, 72), torch.float16, DEVICE, generator(1, DEVICE))
    unaligned = buf[..., 4:68]  # rows of 144 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="tma=True needs 16-byte aligned"):
        triton_flash.flash_attention_forward(unaligned, buf[..., :64], buf[..., :64], tma=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_strided_inputs_and_custom_scale(dtype):
    # (B, N, H, D) memory seen as (B, H, N, D); k and v are halves of one packed (B, N, 2, H, D)
    # tensor
    q, _, _ = make((2, 4, 97, 64), (2, 2, 97, 64), dtype, seed=3, layout="bnhd")
    kv = random_tensor((2, 131, 2, 2, 64), dtype, DEVICE, generator(4, DEVICE))
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for causal in (False, True):
        out, lse = triton_flash.flash_attention_forward(q, k, v, causal, scale=0.3)
        check_forward(out, lse, q, k, v, causal, scale=0.3)


def test_large_logits_do_not_overflow():
    # scores around +-300: exp without subtracting the running maximum would overflow float32
    q, k, v = make((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, seed=5)
    out, lse = triton_flash.flash_attention_forward(q * 20, k * 20, v, False)
    check_forward(out, lse, q * 20, k * 20, v, False)


def test_causal_mask_is_checked():
    """The comparison can fail: a causal result does not pass as the non-causal answer."""
    q, k, v = make((1, 2, 100, 64), (1, 2, 100, 64), torch.float16, seed=6)
    out, lse = triton_flash.flash_attention_forward(q, k, v, True)
    with pytest.raises(AssertionError, match="out: "):
        check_forward(out, lse, q, k, v, False)


def test_naive_attention_matches_fp64():
    q, k, v = make((1, 4, 50, 32), (1, 2, 70, 32), torch.float32, seed=7)
    for causal in (False, True):
        want, _ = reference.attention_fp64(q, k, v, causal=causal)
        assert compare(
            reference.naive_attention(q, k, v, causal=causal), want, atol=1e-6, rtol=1e-5
        ).ok


# ------------------------------------------------------------------------------------------------
# Backward


def grad_magnitudes(q, k, v, do, causal):
    """Per-element magnitude of the terms each gradient sums (float64), for the tolerance."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    p = probabilities(q, k, causal)
    k64 = reference._expand_kv(k.double(), q.shape[1])
    v64 = reference._expand_kv(v.double(), q.shape[1])
    dp = do.double() @ v64.transpose(-1, -2)
    delta = (do.double() * (p @ v64)).sum(-1, keepdim=True)
    ds = p * (dp.abs() + delta.abs())

    def per_kv_head(t):  # sum the group's query heads onto their KV head
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    return (
        scale * ds @ k64.abs(),
        per_kv_head(scale * ds.transpose(-1, -2) @ q.double().abs()),
        per_kv_head(p.transpose(-1, -2) @ do.double().abs()),
    )


BACKWARD_CASES = [
    # (B, Hq, Hkv, Nq, Nk, D), causal, dtype
    ((1, 2, 2, 100, 100, 64), False, torch.float16),
    ((1, 2, 2, 197, 197, 64), True, torch.bfloat16),
    ((1, 4, 2, 70, 150, 32), False, torch.bfloat16),
    ((2, 4, 2, 100, 100, 32), True, torch.float16),
    ((1, 2, 1, 130, 70, 64), True, torch.float16),
    ((1, 2, 2, 3, 200, 128), True, torch.bfloat16),
    ((1, 1, 1, 1, 1, 64), False, torch.float16),
    ((1, runtime.pick(gpu=16, cpu=4), 2, 100, 100, 64), True, torch.bfloat16),
    # padded head dims: 80 (Phi-2), 96 (Phi-3-mini), 192 (DeepSeek-V2's q/k), 40
    ((1, 2, 1, 45, 61, 80), True, torch.float16),
    ((1, 2, 2, 33, 33, 96), False, torch.bfloat16),
    ((1, 2, 1, 29, 47, 192), True, torch.bfloat16),
    ((1, 2, 2, 50, 20, 40), False, torch.float16),
]


@pytest.mark.parametrize(
    "case",
    BACKWARD_CASES,
    ids=lambda c: "B{}_H{}:{}_Nq{}_Nk{}_D{}".format(*c[0])
    + ("_causal" if c[1] else "")
    + "_"
    + str(c[2]).removeprefix("torch."),
)
def test_backward_matches_fp64_autograd(case):
    (b, hq, hkv, nq, nk, d), causal, dtype = case
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq + 3 * nk)
    do = random_tensor((b, hq, nq, d), dtype, DEVICE, generator(99, DEVICE))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference.attention_fp64(q64, k64, v64, causal=causal)[0].backward(do.double())
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    out = triton_flash.flash_attention(qt, kt, vt, causal=causal)
    out.backward(do)
    magnitudes = grad_magnitudes(q, k, v, do, causal)
    for name, got, want, magnitude in zip(
        "qkv", (qt.grad, kt.grad, vt.grad), (q64.grad, k64.grad, v64.grad), magnitudes
    ):
        assert got.dtype == dtype and got.shape == want.shape
        cmp = compare(got, want, atol=TINY[dtype], rtol=4 * ULP[dtype], scale=magnitude)
        assert cmp.ok, f"d{name}: {cmp.reason}"
    # the other way to dQ: float32 atomics from the dK/dV kernel
    out, lse = triton_flash.flash_attention_forward(q, k, v, causal)
    dq, _, _ = triton_flash.flash_attention_backward(
        do, q, k, v, out, lse, causal, 1 / math.sqrt(d), atomic_dq=True
    )
    cmp = compare(dq, q64.grad, atol=TINY[dtype], rtol=4 * ULP[dtype], scale=magnitudes[0])
    assert cmp.ok, f"dq (atomic): {cmp.reason}"


def test_backward_strided_inputs_and_lse_output():
    q, k, v = make((1, 4, 60, 64), (1, 2, 90, 64), torch.float16, seed=8, layout="bnhd")
    do = random_tensor((1, 60, 4, 64), torch.float16, DEVICE, generator(9, DEVICE)).transpose(1, 2)
    qt, kt, vt = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = triton_flash.flash_attention(qt, kt, vt, causal=True, return_lse=True)
    assert not lse.requires_grad
    check_forward(out.detach(), lse, q, k, v, True)
    out.backward(do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference.attention_fp64(q64, k64, v64, causal=True)[0].backward(do.double())
    for got, want, magnitude in zip(
        (qt.grad, kt.grad, vt.grad),
        (q64.grad, k64.grad, v64.grad),
        grad_magnitudes(q, k, v, do, True),
    ):
        cmp = compare(
            got, want, atol=TINY[torch.float16], rtol=4 * ULP[torch.float16], scale=magnitude
        )
        assert cmp.ok, cmp.reason


@pytest.mark.gpu  # CPU mode has a single configuration
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_tuned_config(head_dim):
    """Each entry of the forward, dK/dV and dQ tuning tables, forward and backward, odd lengths,
    causal."""
    q, k, v = make((1, 4, 333, head_dim), (1, 2, 333, head_dim), torch.bfloat16, seed=head_dim)
    do = random_tensor(q.shape, torch.bfloat16, DEVICE, generator(98, DEVICE))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference.attention_fp64(q64, k64, v64, causal=True)[0].backward(do.double())
    magnitudes = grad_magnitudes(q, k, v, do, True)
    entries = max(
        len(t[head_dim])
        for t in (triton_flash.FWD_TUNING, triton_flash.DKDV_TUNING, triton_flash.DQ_TUNING)
    )
    try:
        for i in range(entries):
            triton_flash.TUNING_OVERRIDE = i
            triton_flash.reset_autotuning()
            for tma in (False, True) if runtime.has("tma") else (False,):
                check_forward(*run_forward(flash_forward, q, k, v, True, tma=tma), q, k, v, True)
            out, lse = triton_flash.flash_attention_forward(q, k, v, True)
            for atomic_dq in (False, True):
                grads = triton_flash.flash_attention_backward(
                    do, q, k, v, out, lse, True, head_dim**-0.5, atomic_dq=atomic_dq
                )
                for got, want, magnitude in zip(grads, (q64.grad, k64.grad, v64.grad), magnitudes):
                    cmp = compare(
                        got,
                        want,
                        atol=TINY[torch.bfloat16],
                        rtol=4 * ULP[torch.bfloat16],
                        scale=magnitude,
                    )
                    assert cmp.ok, f"table entry {i}, atomic_dq={atomic_dq}: {cmp.reason}"
    finally:
        triton_flash.TUNING_OVERRIDE = 0
        triton_flash.reset_autotuning()


# ------------------------------------------------------------------------------------------------
# Decode


DECODE_CASES = [
    # (B, Hq, Hkv, Nq, Nk, D), causal, num_splits (None: the default for this machine)
    ((1, 8, 2, 1, 1000, 128), False, None),
    ((1, 8, 2, 1, 1000, 128), True, 5),
    ((2, 4, 2, 3, 517, 64), True, None),
    ((1, 4, 4, 1, 100, 32), False, 7),  # more splits than key blocks: the wrapper recounts
    ((1, 4, 2, 4, 3, 64), True, None),  # Nq > Nk: the first query sees no key
    ((1, 16, 2, 3, 300, 64), True, None),  # 8 query heads x 3 queries: 24 rows per program
    ((1, 4, 2, 1, 4500, 64), False, 70),  # the combine walks 70 splits
    ((1, 4, 1, 1, 300, 80), False, 3),  # padded head dims: 80, 96, 192
    ((2, 6, 2, 2, 257, 96), True, None),
    ((1, 2, 1, 1, 150, 192), True, 2),
]


@pytest.mark.parametrize("fuse_combine", [True, False], ids=["fused-combine", "combine-launch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    DECODE_CASES,
    ids=lambda c: "B{}_H{}:{}_Nq{}_Nk{}_D{}".format(*c[0])
    + ("_causal" if c[1] else "")
    + f"_splits{c[2]}",
)
def test_decode_matches_fp64(case, dtype, fuse_combine):
    (b, hq, hkv, nq, nk, d), causal, splits = case
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nk + nq)
    check_forward(
        *run_forward(decode_forward, q, k, v, causal, num_splits=splits, fuse_combine=fuse_combine),
        q,
        k,
        v,
        causal,
    )


def test_fused_combine_leaves_its_counters_at_zero_and_repeats():
    """The last program of each group resets its arrival counter: a second call on new values (and a
    different number of splits) is as right as the first, and a counter left non-zero would make the
    wrong program combine (or none)."""
    for trial, splits in enumerate((5, 9, 9)):
        q, k, v = make((2, 8, 1, 64), (2, 2, 700, 64), torch.float16, seed=100 + trial)
        check_forward(
            *run_forward(decode_forward, q, k, v, False, num_splits=splits), q, k, v, False
        )
        assert not triton_decode._ARRIVALS[q.device].any(), "arrival counters not reset"


@pytest.mark.gpu  # races need concurrent programs, which the interpreter runs in turn
def test_fused_combine_has_no_race_on_the_gpu():
    """Many calls on fresh values at the benchmark's shape (50 splits per KV head arriving
    concurrently): a combine that read a partial before it was written would differ from the
    two-launch path."""
    for trial in range(30):
        q, k, v = make(
            (1, 32, 1, 128), (1, 8, 4096 + 37 * trial, 128), torch.float16, seed=200 + trial
        )
        fused = triton_decode.flash_decode(q, k, v, return_lse=True)
        split = triton_decode.flash_decode(q, k, v, return_lse=True, fuse_combine=False)
        assert torch.equal(fused[0], split[0]) and torch.equal(fused[1], split[1]), f"trial {trial}"


def test_decode_strided_kv_cache():
    # a preallocated cache of 300 slots of which 257 are filled: k and v are strided views
    cache = random_tensor((2, 1, 300, 2, 64), torch.bfloat16, DEVICE, generator(10, DEVICE))
    k, v = cache[0, :, :257].transpose(1, 2), cache[1, :, :257].transpose(1, 2)
    q = random_tensor((1, 8, 1, 64), torch.bfloat16, DEVICE, generator(11, DEVICE))
    out, lse = triton_decode.flash_decode(q, k, v, True, return_lse=True)
    check_forward(out, lse, q, k, v, True)


def test_repeated_calls_take_the_cached_launch_and_stay_right():
    """The second call with the same signature launches the cached compiled kernel (on a GPU): new
    values, the same shapes, then the same shapes at an address that is not 16-byte aligned (which
    Triton compiles differently: a new key), each against fp64."""
    triton_decode.SPLIT_LAUNCHES.clear()
    flat = random_tensor((2 * 2 * 80 * 64 + 1,), torch.float16, DEVICE, generator(14, DEVICE))
    for trial in range(3):
        q, k, v = make((2, 8, 1, 64), (2, 2, 80, 64), torch.float16, seed=300 + trial)
        if trial == 2:
            k = flat[1:].view(2, 2, 80, 64)  # 2 bytes past an aligned address
            assert k.data_ptr() % 16 != 0
        check_forward(*run_forward(decode_forward, q, k, v, True), q, k, v, True)
        check_forward(*run_forward(flash_forward, k, k, v, True), k, k, v, True)
    if runtime.ON_GPU:
        assert triton_decode.SPLIT_LAUNCHES.entries and triton_flash.FWD_LAUNCHES.entries
        # one entry for the aligned calls, one for the unaligned k
        assert len(triton_decode.SPLIT_LAUNCHES.entries) == 2


def test_no_grad_path_equals_the_autograd_path():
    q, k, v = make((1, 4, 50, 64), (1, 2, 50, 64), torch.bfloat16, seed=15)
    plain = triton_flash.flash_attention(q, k, v, causal=True)
    tracked = triton_flash.flash_attention(q.requires_grad_(), k, v, causal=True)
    assert tracked.requires_grad and not plain.requires_grad
    assert torch.equal(plain, tracked.detach())


def test_autograd_path_inside_torch_func_takes_the_ordinary_apply():
    """flash_attention calls the autograd.Function's C++ apply directly, except inside a functorch
    transform, where Function.apply decides (it refuses a Function without setup_context)."""
    q, k, v = make((1, 2, 8, 64), (1, 2, 8, 64), torch.float16, seed=19)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: triton_flash.flash_attention(q, k, v).float().sum())(q)


def test_checks_still_run_after_a_good_call():
    """The checks are cached per input signature: a bad call after good ones is still refused."""
    q, k, v = make((1, 2, 8, 64), (1, 2, 8, 64), torch.float16, seed=16)
    triton_decode.flash_decode(q, k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        triton_decode.flash_decode(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="must be contiguous"):
        triton_decode.flash_decode(q, k, v.transpose(2, 3).contiguous().transpose(2, 3))


def test_prefill_checks_still_run_on_its_hot_path():
    """flash_attention remembers each call with new outputs (one dict lookup per call after the
    first): a bad call after good ones with the same shapes is still refused, with and without
    gradients, and a pointer that is not 16-byte aligned takes the full path."""
    q, k, v = make((1, 2, 8, 64), (1, 2, 8, 64), torch.float16, seed=18)
    want = triton_flash.flash_attention(q, k, v, causal=True)
    assert triton_flash.call_key(q, k, v, True) in triton_flash._FWD_CALLS
    assert torch.equal(triton_flash.flash_attention(q, k, v, causal=True), want)
    with pytest.raises(TypeError, match="share a dtype"):
        triton_flash.flash_attention(q, k.bfloat16(), v, causal=True)
    with pytest.raises(ValueError, match="must be contiguous"):
        triton_flash.flash_attention(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), True)
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        triton_flash.flash_attention(q[0], k, v, causal=True)
    for scale in (-1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="scale must be a positive"):
            triton_flash.flash_attention(q, k, v, causal=True, scale=scale)
        with pytest.raises(ValueError, match="scale must be a positive"):
            triton_flash.flash_attention(q.detach().requires_grad_(), k, v, True, scale=scale)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEVICE)
    shifted = flat[1:].view(q.shape).copy_(q)  # 2 bytes past an aligned address
    before = len(triton_flash._FWD_CALLS)
    assert torch.equal(triton_flash.flash_attention(shifted, k, v, causal=True), want)
    assert len(triton_flash._FWD_CALLS) == before


@pytest.mark.gpu  # the interpreter does not go through JITFunction.run
def test_instrumented_launches_see_every_call(monkeypatch):
    """With Triton's launch path wrapped (a profiler, a launch counter), no launch bypasses it."""
    from triton.runtime.jit import JITFunction

    plain, seen = JITFunction.run, []

    def counting_run(self, *args, **kwargs):
        seen.append(self.fn.__name__)
        return plain(self, *args, **kwargs)

    q, k, v = make((1, 8, 1, 64), (1, 2, 300, 64), torch.float16, seed=17)
    # compiled, autotuned and cached before the wrapper exists (autotuning launches many times)
    triton_decode.flash_decode(q, k, v)
    triton_flash.flash_attention(q, k, v)
    monkeypatch.setattr(JITFunction, "run", counting_run)
    for _ in range(3):
        triton_decode.flash_decode(q, k, v)
        triton_flash.flash_attention(q, k, v)
    assert seen.count("flash_decode_split_kernel") == 3 and seen.count("flash_fwd_kernel") == 3


def test_default_splits_fill_the_gpu():
    if runtime.ON_GPU:
        sms = runtime.gpu_info().sm_count
        splits = triton_decode.default_num_splits(1, 8, 32768)
        assert splits * 8 >= sms, "batch 1 with 8 KV heads must give every SM a program"
    assert triton_decode.default_num_splits(1, 8, 10) == 1  # never more splits than key blocks


# ------------------------------------------------------------------------------------------------
# Errors


def _t(shape, dtype=torch.float16):
    return torch.randn(shape, device=DEVICE).to(dtype)


BAD = [
    (
        "head dims differ",
        lambda: (_t((1, 2, 8, 64)), _t((1, 2, 8, 32)), _t((1, 2, 8, 32))),
        ValueError,
        "head_dim 64 but k and v have head_dim 32",
    ),
    (
        "float32",
        lambda: (_t((1, 2, 8, 64), torch.float32),) * 3,
        TypeError,
        "supported: float16, bfloat16",
    ),
    (
        "mixed dtypes",
        lambda: (_t((1, 2, 8, 64)), _t((1, 2, 8, 64), torch.bfloat16), _t((1, 2, 8, 64))),
        TypeError,
        "share a dtype",
    ),
    (
        "GQA heads do not divide",
        lambda: (_t((1, 6, 8, 64)), _t((1, 4, 8, 64)), _t((1, 4, 8, 64))),
        ValueError,
        "not a multiple of k and v's 4 heads",
    ),
    ("rank 3", lambda: (_t((2, 8, 64)),) * 3, ValueError, "must have 4 dimensions"),
    (
        "batch differs",
        lambda: (_t((2, 2, 8, 64)), _t((1, 2, 8, 64)), _t((1, 2, 8, 64))),
        ValueError,
        "batch 2 but k and v have batch 1",
    ),
    (
        "k and v differ",
        lambda: (_t((1, 2, 8, 64)), _t((1, 2, 8, 64)), _t((1, 2, 9, 64))),
        ValueError,
        "k and v must have the same shape",
    ),
    (
        "head_dim not contiguous",
        lambda: (_t((1, 2, 8, 64)), _t((1, 2, 64, 8)).transpose(2, 3), _t((1, 2, 8, 64))),
        ValueError,
        "last dimension .* must be contiguous",
    ),
    (
        "head_dim not a multiple of 8",
        lambda: (_t((1, 2, 8, 36)),) * 3,
        ValueError,
        "head_dim 36 is not supported",
    ),
    (
        "head_dim above 256",
        lambda: (_t((1, 2, 8, 264)),) * 3,
        ValueError,
        "head_dim 264 is not supported; supported: multiples of 8 up to 256",
    ),
    (
        "not a tensor",
        lambda: (_t((1, 2, 8, 64)).tolist(), _t((1, 2, 8, 64)), _t((1, 2, 8, 64))),
        TypeError,
        "q must be a torch.Tensor",
    ),
]


@pytest.mark.parametrize(
    "fn",
    [triton_flash.flash_attention, triton_decode.flash_decode],
    ids=["flash_attention", "flash_decode"],
)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_clearly(case, fn):
    _, args, error, message = case
    with pytest.raises(error, match=message):
        fn(*args())


def test_bad_scale_and_decode_rows():
    q, k, v = make((1, 2, 8, 64), (1, 2, 8, 64), torch.float16, seed=12)
    with pytest.raises(ValueError, match="scale must be a positive"):
        triton_flash.flash_attention(q, k, v, scale=-1.0)
    q, k, v = make((1, 32, 4, 64), (1, 1, 8, 64), torch.float16, seed=13)
    with pytest.raises(ValueError, match="use flash_attention for long queries"):
        triton_decode.flash_decode(q, k, v)


def test_wrong_device_is_named():
    other = "cuda" if not runtime.ON_GPU else "cpu"
    q = torch.empty((1, 1, 4, 64), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=f"expected a {DEVICE} tensor"):
        check_attention_inputs(q, q, q)
    with pytest.raises(ValueError, match=f"expected a {other} tensor"):
        check_attention_inputs(q, q, q, device=other)
