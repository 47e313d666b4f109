"""The decode GEMV with the residual add + RMSNorm before it and SwiGLU after it
(kernels/decoder/triton_fused_gemv.py): against a float64 reference written here from the formula,
against the unfused path (module 02's norm, triton_gemv.linear, triton_ops.swiglu), the new
residual written once and only once, strided views, bad arguments; then the decoder with its
decode step fused, against the float64 spec, its unfused step and Hugging Face.

CPU: the interpreter, on sizes small enough to keep the file well under a minute; GPU: N = 2047,
K = 1000 (neither a multiple of any block), the autotuned path and every GPU configuration."""

import copy

import numpy as np
import pytest
import torch
import triton

from kernels import runtime
from kernels.decoder import hf_reference, reference, triton_fused_gemv, triton_gemv, triton_ops
from kernels.decoder.config import NORMED_PROJECTIONS, TINY
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.rmsnorm import triton_rmsnorm
from kernels.testing import ULP, compare, generator, poison_, random_tensor

DEVICE = runtime.DEVICE
# Output columns (rows of W; twice as many with SwiGLU) and K: odd, and not a multiple of any
# BLOCK_N or BLOCK_K.
N, K = runtime.pick(gpu=(2047, 1000), cpu=(103, 150))
LLAMA_EPS = 1e-5
CONFIGS = runtime.pick(
    gpu=triton_fused_gemv.GPU_CONFIGS, cpu=list(triton_gemv.CPU_CONFIGS.values())
)
fused = triton_fused_gemv.add_rms_norm_linear


def config_id(config) -> str:
    kw = config.kwargs
    path = "dot" if kw["USE_DOT"] else "broadcast"
    return f"{path}-n{kw['BLOCK_N']}-k{kw['BLOCK_K']}-s{config.num_stages}"


def inputs(m, dtype, seed, *, swiglu=False, n=N, k=K):
    """delta, residual (m, k), norm weight (k,), W (n or 2 n, k): fresh normal values."""
    g = generator(seed, DEVICE)
    delta, residual = (random_tensor((m, k), dtype, DEVICE, g) for _ in range(2))
    norm_weight = random_tensor((k,), dtype, DEVICE, g)
    weight = random_tensor(((2 if swiglu else 1) * n, k), dtype, DEVICE, g)
    return delta, residual, norm_weight, weight


def fp64_spec(delta, residual, norm_weight, weight, eps, swiglu):
    """The formula, from scratch: r = delta + residual (rounded to the dtype the model stores it
    in), y = r / rms(r) * norm_weight, out = y @ W.T, then silu(gate) * up."""
    r = residual.double() if delta is None else delta.double() + residual.double()
    r = r.to(residual.dtype).double()
    y = r / torch.sqrt((r * r).sum(1, keepdim=True) / r.shape[1] + eps) * norm_weight.double()
    out = y @ weight.double().T
    if swiglu:
        gate, up = out.chunk(2, dim=1)
        out = torch.nn.functional.silu(gate) * up
    return out


def assert_matches(out, delta, residual, norm_weight, weight, eps, swiglu):
    result = triton_fused_gemv.check(out, delta, residual, norm_weight, weight, eps, swiglu=swiglu)
    assert result.ok, result.reason


def assert_new_residual(r, delta, residual):
    """r is delta + residual rounded once to the dtype, and the same bits as module 02's."""
    exact = delta.double() + residual.double()
    result = compare(r, exact, atol=0.0, rtol=ULP[r.dtype])
    assert result.ok, result.reason
    ones = torch.ones_like(residual[0])
    _, unfused = triton_rmsnorm.fused_add_rms_norm(delta.contiguous(), residual.contiguous(), ones)
    assert torch.equal(r, unfused)


# --------------------------------------------------------------------------------------------------
# Against float64


CASES = [  # (rows, dtype, swiglu, with delta): 1 to 32 rows, both paths of the CPU's choice
    (1, torch.bfloat16, False, True),
    (1, torch.float16, True, True),
    (3, torch.bfloat16, True, True),
    (3, torch.float16, False, False),
    (17, torch.float16, False, True),
    (17, torch.bfloat16, True, False),
    (32, torch.bfloat16, False, True),
    (32, torch.float16, True, True),
]


@pytest.mark.parametrize("m, dtype, swiglu, with_delta", CASES)
def test_matches_fp64(m, dtype, swiglu, with_delta):
    """The default path (autotuned on a GPU); the output and the new residual poisoned first."""
    delta, residual, norm_weight, weight = inputs(m, dtype, seed=m, swiglu=swiglu)
    delta = delta if with_delta else None
    out = poison_(torch.empty(m, N, dtype=dtype, device=DEVICE))
    r_out = poison_(torch.empty(m, K, dtype=dtype, device=DEVICE)) if with_delta else None
    kept = residual.clone()
    got, r = fused(
        delta, residual, norm_weight, weight, LLAMA_EPS, swiglu=swiglu, out=out, residual_out=r_out
    )
    assert got is out
    assert_matches(out, delta, residual, norm_weight, weight, LLAMA_EPS, swiglu)
    assert torch.equal(residual, kept)  # read, never written
    if with_delta:
        assert r is r_out
        assert_new_residual(r, delta, residual)
    else:
        assert r is residual  # nothing added: the residual stream is unchanged


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize(
    "m, dtype, swiglu", [(3, torch.float16, True), (17, torch.bfloat16, False)]
)
def test_every_configuration_matches_fp64(config, m, dtype, swiglu):
    """Every configuration at rows the default would give the other path (on the CPU: the dot
    programs at 3 rows, the broadcast ones at 17), with a large eps: dropping it shows."""
    eps = 0.7
    delta, residual, norm_weight, weight = inputs(m, dtype, seed=100 + m, swiglu=swiglu)
    out = poison_(torch.empty(m, N, dtype=dtype, device=DEVICE))
    _, r = fused(delta, residual, norm_weight, weight, eps, swiglu=swiglu, out=out, config=config)
    assert_matches(out, delta, residual, norm_weight, weight, eps, swiglu)
    assert_new_residual(r, delta, residual)


def test_the_check_is_independent_of_the_kernel_and_tight():
    """check agrees with the formula written here, and rejects what a wrong kernel would give: the
    last block of K left out, eps left out, a gate paired with its neighbour's up."""
    dtype, m, eps = torch.float16, 5, 0.7
    for swiglu in (False, True):
        d, r, nw, w = inputs(m, dtype, seed=7, swiglu=swiglu)
        spec = fp64_spec(d, r, nw, w, eps, swiglu)
        assert triton_fused_gemv.check(spec.to(dtype), d, r, nw, w, eps, swiglu=swiglu).ok
        short = slice(0, K - K % 64)  # the last (partial) block of the dot programs' K
        wrong = {
            "short K": fp64_spec(d[:, short], r[:, short], nw[short], w[:, short], eps, swiglu),
            "no eps": fp64_spec(d, r, nw, w, 0.0, swiglu),
        }
        if swiglu:
            wrong["gate with the wrong up"] = fp64_spec(
                d, r, nw, torch.cat(w.chunk(2)[:1] + (w.chunk(2)[1].roll(1, 0),)), eps, swiglu
            )
        for name, value in wrong.items():
            ok = triton_fused_gemv.check(value.to(dtype), d, r, nw, w, eps, swiglu=swiglu).ok
            assert not ok, f"swiglu={swiglu}: {name} passed"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fp16_residual_outliers_do_not_overflow(config):
    """A residual stream keeps outliers of thousands (fp16 holds up to 65504), and norm weights
    above 1 are common. The unfused path scales by 1/rms before anything is rounded; the fused one
    multiplies r by norm_weight first and applies 1/rms at the end, so its fp16 operand of the
    tensor cores must not hold r * norm_weight itself: 40000 * 4 is past fp16's range."""
    delta, residual, norm_weight, weight = inputs(2, torch.float16, seed=17)
    residual[:, ::7] = 40000.0  # outlier channels, as in real residual streams
    norm_weight[::7] = 4.0
    out, _ = fused(delta, residual, norm_weight, weight, LLAMA_EPS, config=config)
    assert_matches(out, delta, residual, norm_weight, weight, LLAMA_EPS, swiglu=False)


def test_matches_the_unfused_path():
    """The same bits of residual as module 02's fused_add_rms_norm; both outputs within check's
    bound of float64 (so within twice that bound of each other: the unfused path rounds y before
    the GEMV, the fused one does not)."""
    for m, dtype, swiglu in [(1, torch.bfloat16, True), (5, torch.float16, False)]:
        delta, residual, norm_weight, weight = inputs(m, dtype, seed=31 + m, swiglu=swiglu)
        out, r = fused(delta, residual, norm_weight, weight, LLAMA_EPS, swiglu=swiglu)
        y, r_unfused = triton_rmsnorm.fused_add_rms_norm(delta, residual, norm_weight, LLAMA_EPS)
        unfused = triton_gemv.linear(y, weight)
        unfused = triton_ops.swiglu(unfused) if swiglu else unfused
        assert torch.equal(r, r_unfused)
        for name, value in (("fused", out), ("unfused", unfused)):
            result = triton_fused_gemv.check(
                value, delta, residual, norm_weight, weight, LLAMA_EPS, swiglu=swiglu
            )
            assert result.ok, f"{name}: {result.reason}"


# --------------------------------------------------------------------------------------------------
# The new residual: one writer, another buffer


@pytest.mark.cpu
def test_the_new_residual_is_written_once_by_one_program(monkeypatch):
    """Every element of residual_out is stored exactly once in a launch of several programs, and
    nothing is stored into residual or delta (the interpreter's stores, counted by address)."""
    from triton.runtime import interpreter

    stored = []
    store = interpreter.InterpreterBuilder.create_masked_store

    def counting_store(self, ptrs, value, mask, cache_policy):
        stored.append(ptrs.data[mask.data.astype(bool)].copy())
        return store(self, ptrs, value, mask, cache_policy)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", counting_store)
    for config in triton_gemv.CPU_CONFIGS.values():
        stored.clear()
        delta, residual, norm_weight, weight = inputs(3, torch.bfloat16, seed=41, swiglu=True)
        out, r = fused(delta, residual, norm_weight, weight, LLAMA_EPS, swiglu=True, config=config)
        assert triton.cdiv(N, config.kwargs["BLOCK_N"]) > 1  # several programs
        addresses = torch.from_numpy(np.concatenate(stored).astype(np.int64))
        for name, t, times in (
            ("r", r, 1),
            ("out", out, 1),
            ("residual", residual, 0),
            ("delta", delta, 0),
        ):
            first = t.data_ptr()
            inside = (addresses >= first) & (addresses < first + t.numel() * t.element_size())
            nbytes = t.numel() * t.element_size()
            counts = torch.bincount(addresses[inside] - first, minlength=nbytes)
            per_element = counts[:: t.element_size()]
            assert (per_element == times).all(), (
                f"{name}: stores per element {per_element.unique()}"
            )
        assert_new_residual(r, delta, residual)


def test_in_place_residual_is_refused():
    """residual_out over residual (or over delta, or out over an input) would let the programs
    still reading it see values already updated: refused, with the reason."""
    delta, residual, norm_weight, weight = inputs(2, torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="residual_out overlaps residual.*separate buffer"):
        fused(delta, residual, norm_weight, weight, LLAMA_EPS, residual_out=residual)
    with pytest.raises(ValueError, match="residual_out overlaps delta"):
        fused(delta, residual, norm_weight, weight, LLAMA_EPS, residual_out=delta)
    both = random_tensor((2, 2 * K), torch.bfloat16, DEVICE)
    with pytest.raises(ValueError, match="residual_out overlaps residual"):
        fused(delta, both[:, :K], norm_weight, weight, LLAMA_EPS, residual_out=both[:, 1 : K + 1])
    d, r, nw, w = inputs(2, torch.bfloat16, seed=6, n=24, k=32)
    with pytest.raises(ValueError, match="out overlaps delta"):
        fused(d, r, nw, w, LLAMA_EPS, out=d[:, :24])


# --------------------------------------------------------------------------------------------------
# Views


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_views(dtype):
    """delta, residual, out and residual_out may be row-strided views (columns of wider buffers,
    every other row); only their own elements are written."""
    m, swiglu = 3, dtype == torch.float16
    g = generator(13, DEVICE)
    _, _, norm_weight, weight = inputs(m, dtype, seed=13, swiglu=swiglu)
    delta = random_tensor((m, K + 20), dtype, DEVICE, g)[:, 7 : 7 + K]
    residual = random_tensor((2 * m, K), dtype, DEVICE, g)[::2]
    out_buffer = torch.full((m, N + 9), 1024.0, dtype=dtype, device=DEVICE)
    r_buffer = torch.full((2 * m, K + 3), 1024.0, dtype=dtype, device=DEVICE)
    out = poison_(out_buffer[:, 4 : 4 + N])
    r_out = poison_(r_buffer[::2, 3:])
    fused(delta, residual, norm_weight, weight, 0.3, swiglu=swiglu, out=out, residual_out=r_out)
    assert_matches(out, delta, residual, norm_weight, weight, 0.3, swiglu)
    assert_new_residual(r_out, delta, residual)
    assert (out_buffer[:, :4] == 1024).all() and (out_buffer[:, 4 + N :] == 1024).all()
    assert (r_buffer[1::2] == 1024).all() and (r_buffer[::2, :3] == 1024).all()


# --------------------------------------------------------------------------------------------------
# Bad arguments: a clear error before anything is launched


def test_bad_arguments_are_refused_with_what_to_do():
    dtype = torch.bfloat16
    d, r, nw, w = inputs(2, dtype, seed=3, n=24, k=16)
    eps = LLAMA_EPS
    with pytest.raises(TypeError, match="float32.*use fused_add_rms_norm and F.linear"):
        fused(d.float(), r.float(), nw.float(), w.float(), eps)
    with pytest.raises(TypeError, match="weight is torch.float16 but residual is torch.bfloat16"):
        fused(d, r, nw, w.half(), eps)
    with pytest.raises(TypeError, match="norm_weight must be a torch.Tensor"):
        fused(d, r, nw.tolist(), w, eps)
    with pytest.raises(ValueError, match="this kernel runs on"):
        fused(d.to("meta"), r.to("meta"), nw.to("meta"), w.to("meta"), eps)
    with pytest.raises(ValueError, match="delta must be 2-D"):
        fused(d[0], r[0], nw, w, eps)
    with pytest.raises(ValueError, match=r"delta \(2, 15\) and residual \(2, 16\) must match"):
        fused(d[:, :15], r, nw, w, eps)
    with pytest.raises(ValueError, match=r"norm_weight must be contiguous of shape \(16,\)"):
        fused(d, r, nw[:8], w, eps)
    with pytest.raises(ValueError, match=r"weight must be \(out_features, 16\)"):
        fused(d, r, nw, w[:, :8].contiguous(), eps)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        fused(d, r, nw, random_tensor((24, 32), dtype, DEVICE)[:, :16], eps)
    with pytest.raises(ValueError, match="even number of rows"):
        fused(d, r, nw, w[:23], eps, swiglu=True)
    with pytest.raises(ValueError, match=r"33 rows.*torch.nn.functional.linear"):
        big = random_tensor((33, 16), dtype, DEVICE)
        fused(big, big.clone(), nw, w, eps)
    with pytest.raises(ValueError, match="delta's rows must be contiguous.*contiguous"):
        fused(random_tensor((2, 32), dtype, DEVICE)[:, ::2], r, nw, w, eps)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        fused(d, r, nw, w, -1.0)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 12\)"):
        fused(d, r, nw, w, eps, swiglu=True, out=torch.empty(2, 24, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="residual_out is written only when delta is added"):
        fused(None, r, nw, w, eps, residual_out=torch.empty_like(r))


def test_no_rows_no_launch():
    d, r, nw, w = inputs(0, torch.bfloat16, seed=4, n=24, k=16)
    out, r_new = fused(d, r, nw, w, LLAMA_EPS)
    assert out.shape == (0, 24) and r_new.shape == (0, 16)


# --------------------------------------------------------------------------------------------------
# The decoder with its decode step fused


@pytest.fixture(scope="module")
def tiny_bf16():
    hf = hf_reference.random_llama(TINY, seed=27, dtype=torch.bfloat16, device=DEVICE)
    return hf, Decoder(DecoderWeights.from_hf(hf), max_batch=3, max_seq=16)


def prompt(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, n), generator=g).to(DEVICE)


def test_decoder_fused_decode_step_matches_unfused_spec_and_hf(tiny_bf16, monkeypatch):
    """bf16, 3 sequences, every norm of the decode step folded (2 launches a layer and lm_head's:
    counted): the prefill unchanged; the logits within the bf16 model's tolerance of the float64
    spec, of Hugging Face's model run in float32 on the same weights, and of the unfused step; the
    same greedy tokens; each layer's output (hidden_states) close to the unfused step's."""
    hf, model = tiny_bf16
    batch, tokens = 3, prompt(3, 5, seed=28)
    model.set_decode_fused(batch, ())
    prefill = model.prefill(tokens)
    nxt = torch.argmax(prefill, -1)
    unfused_layers = []
    positions = torch.full((batch,), 5, dtype=torch.int32, device=DEVICE)
    unfused = model.forward(nxt[:, None], positions, 6, hidden_states=unfused_layers)
    calls = []
    kernel = triton_fused_gemv.add_rms_norm_linear
    counted = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)  # noqa: E731
    monkeypatch.setattr(triton_fused_gemv, "add_rms_norm_linear", counted)
    model.set_decode_fused(batch, NORMED_PROJECTIONS)
    try:
        assert torch.equal(model.prefill(tokens), prefill) and not calls
        fused_layers = []
        step = model.forward(nxt[:, None], positions, 6, hidden_states=fused_layers)
    finally:
        model.set_decode_fused(batch, ())
    assert len(calls) == 2 * TINY.n_layers + 1
    tolerance = reference.LOGITS_TOLERANCE[torch.bfloat16]
    sequence = torch.cat([tokens, nxt[:, None]], 1)
    want, _ = reference.forward_fp64(model.w, sequence)
    assert reference.logits_error(step, want[:, -1]) < tolerance
    hf_logits, _ = hf_reference.hidden_states_by_layer(copy.deepcopy(hf).float(), sequence)
    assert reference.logits_error(step, hf_logits[:, -1]) < tolerance
    assert reference.logits_error(step, unfused) < tolerance
    chosen = torch.argmax(step, -1)
    assert hf_reference.near_tie_agreement(unfused, chosen, tolerance).all()
    assert len(fused_layers) == len(unfused_layers) == TINY.n_layers
    for i, (a, b) in enumerate(zip(fused_layers, unfused_layers)):
        scale = b.double().pow(2).mean().sqrt()
        assert float((a.double() - b.double()).abs().max() / scale) < tolerance, f"layer {i}"


def test_decoder_refuses_bad_fused_choices(tiny_bf16):
    _, model = tiny_bf16
    with pytest.raises(ValueError, match="unknown projections.*'o'"):
        model.set_decode_fused(1, ["qkv", "o"])
    with pytest.raises(ValueError, match="1 to 32 rows"):
        model.set_decode_fused(33, ["qkv"])
    hf = hf_reference.random_llama(TINY, seed=29, device=DEVICE)
    fp32 = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=8)
    with pytest.raises(TypeError, match="bf16 or fp16 weights"):
        fp32.set_decode_fused(1, ["gate_up"])
    fp32.set_decode_fused(1, ())  # nothing fused is always allowed


def test_host_breakdown_times_the_fused_wrapper(tiny_bf16, monkeypatch):
    """The H200 run's host split had no row for the fused GEMV (32 calls a step there), so the
    course wrappers' share left them out. Every normed projection fused: 2 per layer + lm_head."""
    from kernels.decoder import benchmark

    monkeypatch.setattr(benchmark, "CONFIG", TINY)
    hf, _ = tiny_bf16
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    model.set_decode_fused(1, NORMED_PROJECTIONS)
    calls = benchmark.host_breakdown(model, batch=1, context=4, steps=1)["calls per step"]
    assert calls["norm + linear (course fused GEMV)"] == 2 * TINY.n_layers + 1
    assert "swiglu" not in calls and "fused_add_rms_norm" not in calls


@pytest.mark.cpu
def test_choosing_fusion_by_timing_needs_a_gpu(tiny_bf16):
    _, model = tiny_bf16
    with pytest.raises(RuntimeError, match="timing needs a GPU"):
        model.choose_decode_fused(1)
    assert model.decode_fused.get(1, frozenset()) == frozenset()  # the default: nothing fused


@pytest.mark.gpu
def test_choose_decode_fused_keeps_the_fastest_whole_step():
    hf = hf_reference.random_llama(TINY, seed=30, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=16)
    model.choose_decode_linears(2)
    step_us = model.choose_decode_fused(2)
    assert len(step_us) == 2 ** len(NORMED_PROJECTIONS)
    assert {"none", "+".join(NORMED_PROJECTIONS)} <= set(step_us)
    assert all(us > 0 for us in step_us.values())
    best = min(step_us, key=step_us.get)
    assert model.decode_fused[2] == (frozenset() if best == "none" else set(best.split("+")))
    model.prefill(prompt(2, 5, seed=33))
    with pytest.raises(RuntimeError, match="cache holds 5 tokens"):
        model.choose_decode_fused(2)


@pytest.mark.gpu
def test_graph_captures_the_fused_step(monkeypatch):
    """bf16, everything fused: the CUDA graph captures it (counted: two warm-up steps and the
    captured one), its replay matches the float64 spec, and a new choice drops the graph."""
    hf = hf_reference.random_llama(TINY, seed=31, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=32)
    model.set_decode_fused(2, NORMED_PROJECTIONS)
    calls = []
    kernel = triton_fused_gemv.add_rms_norm_linear
    counted = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)  # noqa: E731
    monkeypatch.setattr(triton_fused_gemv, "add_rms_norm_linear", counted)
    step = model.capture_decode_graph(2)
    assert len(calls) == 3 * (2 * TINY.n_layers + 1)
    tokens = prompt(2, 9, seed=32)
    nxt = torch.argmax(model.prefill(tokens), -1)
    step.start(nxt, 9)
    step.replay()
    want, _ = reference.forward_fp64(model.w, torch.cat([tokens, nxt[:, None]], 1))
    error = reference.logits_error(step.logits, want[:, -1])
    assert error < reference.LOGITS_TOLERANCE[torch.bfloat16]
    model.set_decode_fused(2, ())
    assert model._graph is None
