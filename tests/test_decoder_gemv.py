"""The decode-time GEMV (kernels/decoder/triton_gemv.py): y = x @ W.T for 1 to 32 rows against a
float64 reference, every configuration, strided views, bad arguments; then the decoder with its
projections forced onto the GEMV, against the float64 spec, and on a GPU the measured choice and the
CUDA-graph step.

CPU: the interpreter, on sizes small enough to keep the file well under a minute; GPU: N = 2047,
K = 1000 (neither a multiple of any block), the autotuned path and every GPU configuration."""

import pytest
import torch

from kernels import runtime
from kernels.decoder import hf_reference, reference, triton_gemv
from kernels.decoder.config import PROJECTIONS, TINY
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.testing import generator, poison_, random_tensor

DEVICE = runtime.DEVICE
DTYPES = [torch.bfloat16, torch.float16]
# Odd, and not a multiple of any BLOCK_N or BLOCK_K of either mode.
N, K = runtime.pick(gpu=(2047, 1000), cpu=(203, 150))
CONFIGS = runtime.pick(gpu=triton_gemv.GPU_CONFIGS, cpu=list(triton_gemv.CPU_CONFIGS.values()))


def config_id(config) -> str:
    kw = config.kwargs
    path = "dot" if kw["USE_DOT"] else "broadcast"
    return f"{path}-n{kw['BLOCK_N']}-k{kw['BLOCK_K']}-s{config.num_stages}"


def inputs(m, n, k, dtype, seed):
    g = generator(seed, DEVICE)
    return random_tensor((m, k), dtype, DEVICE, g), random_tensor((n, k), dtype, DEVICE, g)


def assert_matches(y, x, w):
    result = triton_gemv.check(y, x, w)
    assert result.ok, result.reason


# --------------------------------------------------------------------------------------------------
# Against float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 32])
def test_linear_matches_fp64(m, dtype):
    """The default path: autotuned on a GPU, the interpreter's configuration for this M on a CPU."""
    x, w = inputs(m, N, K, dtype, seed=m)
    y = poison_(torch.empty(m, N, dtype=dtype, device=DEVICE))
    assert triton_gemv.linear(x, w, out=y) is y
    assert_matches(y, x, w)
    assert_matches(triton_gemv.linear(x, w), x, w)  # and with the output allocated


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("m, dtype", [(3, torch.float16), (17, torch.bfloat16)])
def test_every_configuration_matches_fp64(config, m, dtype):
    x, w = inputs(m, N, K, dtype, seed=100 + m)
    y = poison_(torch.empty(m, N, dtype=dtype, device=DEVICE))
    triton_gemv.linear(x, w, out=y, config=config)
    assert_matches(y, x, w)


def test_the_check_rejects_a_missing_product_and_a_wrong_pairing():
    """The tolerance must be tight enough to catch the bugs a GEMV can have: the last column of K
    dropped (a loop bound off by one), a row of W paired with its neighbour's output, one output
    column never written."""
    dtype = torch.bfloat16
    x, w = inputs(5, N, K, dtype, seed=7)
    exact = x.double() @ w.double().T
    assert triton_gemv.check(exact.to(dtype), x, w).ok
    short_k = x[:, :-1].double() @ w[:, :-1].double().T
    assert not triton_gemv.check(short_k.to(dtype), x, w).ok
    shifted = x.double() @ w.roll(1, dims=0).double().T
    assert not triton_gemv.check(shifted.to(dtype), x, w).ok
    unwritten = exact.to(dtype)
    unwritten[:, -1] = float("nan")
    assert not triton_gemv.check(unwritten, x, w).ok


# --------------------------------------------------------------------------------------------------
# Views


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_of_x_and_out(dtype):
    """x may be any 2-D view with contiguous rows: rows of a wider buffer, every other row, one row
    repeated (stride 0). out may be a view too: only its columns are written."""
    g = generator(11, DEVICE)
    w = random_tensor((N, K), dtype, DEVICE, g)
    wide = random_tensor((6, K + 24), dtype, DEVICE, g)
    views = {
        "columns of a wider buffer": wide[:, 5 : 5 + K],
        "every other row": random_tensor((12, K), dtype, DEVICE, g)[::2],
        "a row repeated": wide[2, :K].expand(4, K),
        "one row of a wider buffer": wide[3:4, 7 : 7 + K],
    }
    for name, x in views.items():
        assert x.stride(1) == 1 and not x.is_contiguous() or x.shape[0] == 1, name
        buffer = torch.full((x.shape[0], N + 9), 1024.0, dtype=dtype, device=DEVICE)
        out = poison_(buffer[:, 4 : 4 + N])
        triton_gemv.linear(x, w, out=out)
        result = triton_gemv.check(out, x, w)
        assert result.ok, f"{name}: {result.reason}"
        assert (buffer[:, :4] == 1024).all() and (buffer[:, 4 + N :] == 1024).all(), name


# --------------------------------------------------------------------------------------------------
# Bad arguments: a clear error before anything is launched


def test_bad_arguments_are_refused_with_what_to_do():
    dtype = torch.bfloat16
    x, w = inputs(2, 24, 16, dtype, seed=3)
    linear = triton_gemv.linear
    with pytest.raises(TypeError, match="float32.*use F.linear"):
        linear(x.float(), w.float())
    with pytest.raises(TypeError, match="weight is torch.float16 but x is torch.bfloat16"):
        linear(x, w.half())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        linear(x, w.tolist())
    with pytest.raises(TypeError, match="out has dtype float32"):
        linear(x, w, out=torch.empty(2, 24, device=DEVICE))
    with pytest.raises(ValueError, match="this kernel runs on"):
        linear(x.to("meta"), w.to("meta"))
    with pytest.raises(ValueError, match="x must be 2-D"):
        linear(x[0], w)
    with pytest.raises(ValueError, match=r"weight must be \(out_features, 16\)"):
        linear(x, w[:, :8].contiguous())
    with pytest.raises(ValueError, match=r"33 rows.*torch.nn.functional.linear"):
        linear(random_tensor((33, 16), dtype, DEVICE), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        linear(x, random_tensor((16, 48), dtype, DEVICE)[:, ::2].t())
    with pytest.raises(ValueError, match="x's rows must be contiguous"):
        linear(random_tensor((2, 32), dtype, DEVICE)[:, ::2], w)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 24\)"):
        linear(x, w, out=torch.empty(2, 23, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="out's rows must be contiguous"):
        linear(x, w, out=torch.empty(2, 48, dtype=dtype, device=DEVICE)[:, ::2])


def test_no_rows_no_launch():
    x, w = inputs(0, 24, 16, torch.bfloat16, seed=4)
    assert triton_gemv.linear(x, w).shape == (0, 24)


# --------------------------------------------------------------------------------------------------
# The decoder with its decode-time projections on the GEMV


@pytest.fixture(scope="module")
def tiny_bf16():
    hf = hf_reference.random_llama(TINY, seed=21, dtype=torch.bfloat16, device=DEVICE)
    return Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=16)


def prompt(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, n), generator=g).to(DEVICE)


def test_decoder_decode_step_on_the_gemv_matches_the_fp64_spec(tiny_bf16, monkeypatch):
    """Every projection of the decode step on the GEMV (4 a layer and lm_head: counted), the logits
    within the bf16 model's tolerance of the float64 spec; the prefill still on cuBLAS (identical
    logits whatever the decode choice)."""
    model = tiny_bf16
    tokens = prompt(2, 5, seed=22)
    model.set_decode_linears(2, ())
    cublas_prefill = model.prefill(tokens)
    nxt = torch.argmax(cublas_prefill, -1)
    calls = []
    gemv = triton_gemv.linear
    monkeypatch.setattr(triton_gemv, "linear", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    model.set_decode_linears(2, PROJECTIONS)
    try:
        assert torch.equal(model.prefill(tokens), cublas_prefill) and not calls
        step = model.decode_step(nxt)
    finally:
        model.set_decode_linears(2, ())
    assert len(calls) == 4 * TINY.n_layers + 1
    want, _ = reference.forward_fp64(model.w, torch.cat([tokens, nxt[:, None]], 1))
    assert reference.logits_error(step, want[:, -1]) < reference.LOGITS_TOLERANCE[torch.bfloat16]


def test_decoder_refuses_bad_linear_choices(tiny_bf16):
    with pytest.raises(ValueError, match="unknown projections.*'up'"):
        tiny_bf16.set_decode_linears(1, ["qkv", "up"])
    with pytest.raises(ValueError, match="1 to 32 rows"):
        tiny_bf16.set_decode_linears(33, ["qkv"])
    hf = hf_reference.random_llama(TINY, seed=23, device=DEVICE)
    fp32 = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=8)
    with pytest.raises(TypeError, match="bf16 or fp16 weights"):
        fp32.set_decode_linears(1, ["o"])
    fp32.set_decode_linears(1, ())  # cuBLAS everywhere is always allowed


@pytest.mark.cpu
def test_choosing_by_timing_needs_a_gpu(tiny_bf16):
    with pytest.raises(RuntimeError, match="timing needs a GPU"):
        tiny_bf16.choose_decode_linears(1)
    assert tiny_bf16.decode_gemv.get(1, frozenset()) == frozenset()  # the CPU default: cuBLAS


@pytest.mark.gpu
def test_choose_decode_linears_keeps_the_gemv_only_where_it_was_faster():
    hf = hf_reference.random_llama(TINY, seed=24, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=16)
    measured = model.choose_decode_linears(2)
    assert set(measured) == set(PROJECTIONS)
    for name, m in measured.items():
        assert m["cublas_us"] > 0 and m["gemv_us"] > 0
        assert m["gemv"] == (m["speedup"] > 1.0), name
    assert model.decode_gemv[2] == {n for n, m in measured.items() if m["gemv"]}


@pytest.mark.gpu
def test_graph_captures_the_gemv(monkeypatch):
    """bf16, every projection on the GEMV: the CUDA graph captures it (counted: two warm-up steps
    and the captured one), its replay matches the float64 spec, and a new choice drops the graph.
    (The eager bf16 step attends with flash-decoding, the graph with triton_attention: their logits
    are compared with the spec, not with each other.)"""
    hf = hf_reference.random_llama(TINY, seed=25, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=32)
    model.set_decode_linears(2, PROJECTIONS)
    calls = []
    gemv = triton_gemv.linear
    monkeypatch.setattr(triton_gemv, "linear", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    step = model.capture_decode_graph(2)
    assert len(calls) == 3 * (4 * TINY.n_layers + 1)
    tokens = prompt(2, 9, seed=26)
    nxt = torch.argmax(model.prefill(tokens), -1)
    step.start(nxt, 9)
    step.replay()
    want, _ = reference.forward_fp64(model.w, torch.cat([tokens, nxt[:, None]], 1))
    error = reference.logits_error(step.logits, want[:, -1])
    assert error < reference.LOGITS_TOLERANCE[torch.bfloat16]
    model.set_decode_linears(2, ())
    assert model._graph is None
