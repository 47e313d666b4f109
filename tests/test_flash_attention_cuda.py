"""The CUDA C FlashAttention forward (kernels/flash_attention/flash_attention.cu through CuPy)
against the float64 reference: odd lengths, Nq != Nk, causal (bottom-right aligned), GQA, every
dtype, both head dims, non-contiguous views, poisoned outputs, the lse, and memory that grows with
N, not N^2.

The kernel runs on a GPU only: without one the execution tests are deselected (marked `gpu`);
the argument checks and nvcc compilation (tests/test_cuda_compile.py) are tested everywhere."""

import math

import pytest
import torch

from kernels import runtime
from kernels.flash_attention import cupy_attention
from kernels.flash_attention.reference import attention_fp64
from kernels.testing import TINY, ULP, compare, generator, poison_, random_tensor

gpu_only = pytest.mark.gpu  # CuPy kernels: deselected without a GPU
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (batch, q heads, kv heads, Nq, Nk, head_dim, causal)
SHAPES = [
    (1, 2, 2, 1, 1, 64, False),  # one query, one key
    (1, 2, 2, 1, 1, 128, True),
    (2, 3, 3, 100, 100, 64, True),  # not a multiple of the 16-row block nor the key tile
    (2, 2, 2, 197, 197, 128, False),
    (1, 4, 2, 197, 197, 128, True),  # GQA 2:1
    (1, 2, 1, 1000, 1000, 64, True),
    (1, 2, 2, 1000, 1000, 128, False),
    (2, 2, 2, 100, 197, 64, False),  # cross-attention: Nq != Nk
    (1, 2, 2, 197, 100, 128, False),
    (1, 4, 2, 1, 1000, 128, True),  # decode: one query at the end of a 1000-key cache sees them all
    (1, 2, 2, 37, 1000, 64, True),  # a chunk of queries at the end of a longer cache
    (
        1,
        2,
        2,
        197,
        100,
        64,
        True,
    ),  # Nq > Nk causal: the first 97 queries see no key (out 0, lse -inf)
    (1, 16, 2, 197, 197, 128, True),  # Qwen2's grouping: 16 query heads, 2 KV heads
]


def shape_id(s):
    b, hq, hkv, n_q, n_k, d, causal = s
    return f"b{b}-h{hq}:{hkv}-q{n_q}-k{n_k}-d{d}-{'causal' if causal else 'full'}"


def make_qkv(shape, dtype, seed, logit_scale=1.0):
    b, hq, hkv, n_q, n_k, d, _ = shape
    g = generator(seed, runtime.DEVICE)
    q = random_tensor((b, hq, n_q, d), torch.float32, runtime.DEVICE, g) * logit_scale
    k = random_tensor((b, hkv, n_k, d), torch.float32, runtime.DEVICE, g) * logit_scale
    v = random_tensor((b, hkv, n_k, d), torch.float32, runtime.DEVICE, g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_against_fp64(q, k, v, causal, out, lse):
    """out within one rounding of the output dtype plus float32 error; lse within float32 error; the
    rows that see no key exactly 0 and -inf.

    Tolerances. out is a weighted mean of V rows, so its error is measured against the magnitude of
    the terms, sum_j p_j |v_j| (= the reference attention of |v|), not against |out|, which
    cancellation can make arbitrarily small. One rounding to the dtype is up to 1 ULP of that. The
    float32 part: a score s computed in float32 (a D-term dot product, then scaled) carries an
    absolute error of roughly |s| * 2^-20 at these head dims, which exp turns into a relative error
    of that size in p, so both out's relative and lse's absolute allowance are 2^-20 * (1 + max
    |s|): 5e-6 for unit-normal inputs, 2e-4 when the logits are in the hundreds. A float16 or
    bfloat16 accumulation is 30x to 1000x over.
    """
    want_out, want_lse = attention_fp64(q, k, v, causal=causal)
    magnitude = attention_fp64(q, k, v.abs(), causal=causal)[0]
    s_max = (
        (q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
        .abs()
        .max()
        .item()
        / math.sqrt(q.shape[-1])
        if q.numel() and k.numel()
        else 0.0
    )
    float32_error = 2.0**-20 * (1 + s_max)
    cmp = compare(
        out, want_out, atol=TINY[q.dtype], rtol=ULP[q.dtype] + float32_error, scale=magnitude
    )
    assert cmp.ok, "out: " + cmp.reason
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
    sees_nothing = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), sees_nothing), (
        "lse must be -inf exactly where a row sees no key"
    )
    assert torch.all(out[sees_nothing] == 0), "a row that sees no key must be 0"
    cmp = compare(lse[~sees_nothing], want_lse[~sees_nothing], atol=float32_error, rtol=2.0**-22)
    assert cmp.ok, "lse: " + cmp.reason


def run(q, k, v, causal, out=None, lse=None):
    b, hq, n_q, _ = q.shape
    out = poison_(torch.empty_like(q)) if out is None else poison_(out)
    lse = (
        poison_(torch.empty((b, hq, n_q), dtype=torch.float32, device=q.device))
        if lse is None
        else poison_(lse)
    )
    got_out, got_lse = cupy_attention.flash_attention(q, k, v, causal=causal, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr(), (
        "must write out= and lse="
    )
    return out, lse


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_matches_fp64(shape, dtype):
    q, k, v = make_qkv(shape, dtype, seed=sum(shape[:6]))
    out, lse = run(q, k, v, shape[-1])
    check_against_fp64(q, k, v, shape[-1], out, lse)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_do_not_overflow(dtype, causal):
    # q and k 8x larger: scores in the hundreds, exp(score) overflows float32 (and float16 at 11):
    # only a softmax relative to the running max stays finite.
    shape = (1, 2, 2, 197, 197, 64, causal)
    q, k, v = make_qkv(shape, dtype, seed=11, logit_scale=8.0)
    out, lse = run(q, k, v, causal)
    assert lse.max().item() > 100, "the test should produce scores large enough to overflow exp"
    check_against_fp64(q, k, v, causal, out, lse)


@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_non_contiguous_views(d):
    # q, k, v and out as (B, N, H, D) tensors transposed to (B, H, N, D): only the last dim is
    # contiguous; k and v also taken every other head of a wider tensor.
    g = generator(5, "cuda")
    b, hq, hkv, n_q, n_k = 2, 4, 2, 100, 197
    q = random_tensor((b, n_q, hq, d), torch.bfloat16, "cuda", g).transpose(1, 2)
    k = random_tensor((b, n_k, 2 * hkv, d), torch.bfloat16, "cuda", g).transpose(1, 2)[:, ::2]
    v = random_tensor((b, n_k, 2 * hkv, d), torch.bfloat16, "cuda", g).transpose(1, 2)[:, 1::2]
    out = torch.empty((b, n_q, hq, d), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or out.is_contiguous())
    for causal in (False, True):
        got_out, lse = run(q, k, v, causal, out=out)
        check_against_fp64(q, k, v, causal, got_out, lse)


@gpu_only
def test_allocates_outputs_and_new_values_give_new_results():
    shape = (1, 4, 2, 197, 197, 64, True)
    q, k, v = make_qkv(shape, torch.float16, seed=1)
    out1, lse1 = cupy_attention.flash_attention(q, k, v, causal=True)
    assert out1.is_contiguous() and lse1.dtype == torch.float32
    check_against_fp64(q, k, v, True, out1, lse1)
    q2, k2, v2 = make_qkv(shape, torch.float16, seed=2)
    out2, lse2 = cupy_attention.flash_attention(q2, k2, v2, causal=True)
    check_against_fp64(q2, k2, v2, True, out2, lse2)


@gpu_only
def test_explicit_scale():
    shape = (1, 2, 2, 100, 100, 128, False)
    q, k, v = make_qkv(shape, torch.float16, seed=3)
    out, lse = cupy_attention.flash_attention(q, k, v, scale=0.3)
    want_out, want_lse = attention_fp64(q, k, v, scale=0.3)
    magnitude = attention_fp64(q, k, v.abs(), scale=0.3)[0]
    assert compare(
        out, want_out, atol=TINY[torch.float16], rtol=ULP[torch.float16] + 2**-16, scale=magnitude
    ).ok
    assert compare(lse, want_lse, atol=2**-16, rtol=2**-22).ok


@gpu_only
def test_memory_grows_with_n_not_n_squared():
    # (1, 16, 4096, 64) fp16: the naive version's float16 scores alone are 16 * 4096^2 * 2 B = 512
    # MiB; the flash kernel allocates out (8 MiB) and lse (256 KiB) and nothing else.
    shape = (1, 16, 16, 4096, 4096, 64, True)
    q, k, v = make_qkv(shape, torch.float16, seed=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = cupy_attention.flash_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= out.numel() * out.element_size() + lse.numel() * 4 + 2**20, (
        f"{extra / 2**20:.1f} MiB extra"
    )
    naive_scores = 16 * 4096 * 4096 * 2
    assert extra * 50 < naive_scores


# Argument checks: the same function the kernel wrapper calls, reached without a GPU.
BAD = [
    (
        "head dim 32",
        lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]),
        {},
        ValueError,
        "head_dim 32",
    ),
    ("head dims differ", lambda q, k, v: (q, k[..., :32], v[..., :32]), {}, ValueError, "head_dim"),
    ("float64", lambda q, k, v: (q.double(), k.double(), v.double()), {}, TypeError, "supported"),
    ("GQA not divisible", lambda q, k, v: (q[:, :3], k, v), {}, ValueError, "multiple of"),
    ("3-D input", lambda q, k, v: (q[0], k[0], v[0]), {}, ValueError, "4 dimensions"),
    (
        "last dim strided",
        lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v),
        {},
        ValueError,
        "contiguous",
    ),
    ("bad scale", lambda q, k, v: (q, k, v), {"scale": -1.0}, ValueError, "scale"),
    ("out wrong dtype", lambda q, k, v: (q, k, v), {"out": "float32"}, ValueError, "out must have"),
    (
        "lse wrong dtype",
        lambda q, k, v: (q, k, v),
        {"lse": "float16"},
        ValueError,
        "lse must be a float32",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_clearly(case):
    _, make, extra, error, message = case
    q, k, v = make_qkv((1, 4, 2, 8, 8, 64, False), torch.float16, seed=0)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device) if extra.get("out") else None
    lse = (
        torch.empty(q.shape[:3], dtype=torch.float16, device=q.device) if extra.get("lse") else None
    )
    with pytest.raises(error, match=message):
        cupy_attention.check_args(
            *make(q, k, v), extra.get("scale"), out, lse, device=runtime.DEVICE
        )


def test_without_a_gpu_the_error_says_so():
    q, k, v = make_qkv((1, 2, 2, 8, 8, 64, False), torch.float16, seed=0)
    if runtime.cupy_status()[0]:
        with pytest.raises(ValueError, match=r"move it with \.cuda\(\)"):
            cupy_attention.flash_attention(q.cpu(), k.cpu(), v.cpu())
    else:
        with pytest.raises(RuntimeError, match="need an NVIDIA GPU"):
            cupy_attention.flash_attention(q, k, v)


def test_every_variant_the_wrapper_launches_is_compiled(tmp_path):
    """The wrapper's kernel names exist in the .cu file, and each block fits the 48 KB of static
    shared memory and the register file at 128 threads (read off ptxas for sm_90)."""
    import re
    import subprocess

    from kernels import cuda

    src = cuda.source_path("flash_attention/flash_attention.cu")
    report = subprocess.run(
        [
            cuda.nvcc_path(),
            "-cubin",
            "-arch=sm_90",
            "-std=c++17",
            "-Xptxas",
            "-v",
            f"-I{src.parent}",
            *(f"-I{d}" for d in cuda.cuda_include_dirs()),
            "-o",
            str(tmp_path / "fa.cubin"),
            str(src),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    found = {
        name: (int(regs), int(smem))
        for name, regs, smem in re.findall(
            r"Compiling entry function '(\w+)'.*?Used (\d+) registers.*?(\d+) bytes smem",
            report,
            re.DOTALL,
        )
    }
    for suffix in cupy_attention.SUFFIX.values():
        for d in cupy_attention.HEAD_DIMS:
            for kind in ("full", "causal"):
                name = f"flash_attention_fwd_{suffix}_d{d}_{kind}"
                assert name in found, (
                    f"wrapper would launch {name}, which flash_attention.cu does not define"
                )
                regs, smem = found[name]
                assert smem <= 48 * 1024 and regs * cupy_attention.THREADS <= 65536, (
                    name,
                    regs,
                    smem,
                )
