"""The capstone decoder: each kernel against its float64 reference, then the whole model against
Hugging Face's LlamaForCausalLM (hidden states after every layer, logits, greedy generation), and
the errors and refusals that keep a KV cache intact.

CPU: the tiny config through the Triton interpreter, in float32 (greedy sequences must be identical)
and bfloat16 (the FlashAttention-2 and flash-decoding path of modules 03). GPU: the Llama-3.2-1B
shape in bfloat16 against Hugging Face with the near-tie rule, the CUDA C RoPE, and the CUDA-graph
step."""

import copy

import pytest
import torch

from kernels import runtime
from kernels.decoder import (
    cupy_rope,
    hf_reference,
    reference,
    triton_attention,
    triton_ops,
    triton_rope,
)
from kernels.decoder.config import LLAMA_1B, TINY, DecoderConfig
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.testing import ULP, compare, generator, poison_, random_tensor

DEVICE = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16 greedy: two implementations may pick either of two logits closer than this fraction of the
# logits' rms (the size of their bf16 disagreement, LOGITS_TOLERANCE)
NEAR_TIE = reference.LOGITS_TOLERANCE[torch.bfloat16]
# GPU tests (CuPy, CUDA graphs) carry the `gpu` mark: the runner deselects them on a CPU
gpu = pytest.mark.gpu


def inv_freq(head_dim, theta=10000.0):
    return (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(DEVICE)


# ------------------------------------------------------------------------------------------------
# RoPE


def rope_check(x, positions, freqs, y, dtype):
    want = reference.rope_fp64(x, positions, freqs)
    half = x.shape[-1] // 2
    mag = (x[..., :half].double().abs() + x[..., half:].double().abs()).repeat(1, 1, 2)
    # one rounding of the output; the sine and cosine of float32 cost a few ulp of float32 more
    result = compare(y, want, atol=0.0, rtol=ULP[dtype] + 8 * ULP[torch.float32], scale=mag)
    assert result.ok, result.reason


ROPES = {"triton": triton_rope.rope, "cuda": cupy_rope.rope}


@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_matches_fp64(impl, dtype, pos_dtype):
    g = generator(1, DEVICE)
    # 13 tokens, 5 heads, head_dim 24 (12 pairs: not a power of two); positions neither sorted nor
    # contiguous, one large (the angle's float32 rounding matters there)
    x = random_tensor((13, 5, 24), dtype, DEVICE, g)
    positions = torch.tensor([7, 0, 3, 3, 100, 4095, 1, 2, 9, 65535, 5, 6, 8], dtype=pos_dtype,
                             device=DEVICE)
    y = poison_(torch.empty_like(x))
    ROPES[impl](x, positions, inv_freq(24), out=y)
    rope_check(x, positions, inv_freq(24), y, dtype)


@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_rope_strided_and_in_place(impl):
    """q and k as slices of a fused qkv row (strided tokens and heads), rotated in place."""
    g = generator(2, DEVICE)
    qkv = random_tensor((9, 2 * 7 * 16), torch.bfloat16, DEVICE, g).view(9, 14, 16)
    q = qkv[:, 1:12:2]  # every other head: a head stride of 32 elements
    before = q.clone()
    positions = torch.arange(9, dtype=torch.int32, device=DEVICE) * 3
    ROPES[impl](q, positions, inv_freq(16), out=q)
    rope_check(before, positions, inv_freq(16), q, torch.bfloat16)
    assert torch.equal(qkv[:, 0], qkv[:, 0])  # untouched heads stay (and are not NaN)
    untouched = qkv[:, 0:14:2]
    assert not torch.isnan(untouched.float()).any()


@pytest.mark.cpu  # on a GPU the CUDA C kernel runs in the tests above
def test_cuda_rope_says_it_needs_a_gpu():
    x = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="need an NVIDIA GPU"):
        cupy_rope.rope(x, torch.zeros(2, dtype=torch.int32), inv_freq(8))


def test_rope_is_half_split_not_interleaved():
    """Position 1 with inv_freq 1: pair (0, D/2) rotates, so x[0] moves into y[D/2]."""
    x = torch.zeros(1, 1, 8, device=DEVICE)
    x[0, 0, 0] = 1.0
    y = triton_rope.rope(x, torch.ones(1, dtype=torch.int32, device=DEVICE),
                         torch.ones(4, device=DEVICE))
    angle = torch.tensor(1.0)
    assert torch.allclose(y[0, 0, 0].cpu(), angle.cos()) and torch.allclose(y[0, 0, 4].cpu(),
                                                                            angle.sin())
    assert y[0, 0, 1].item() == 0.0


def test_rope_rejects_bad_arguments():
    x = torch.randn(3, 2, 8, device=DEVICE)
    with pytest.raises(TypeError, match="positions must be an int32 or int64"):
        triton_rope.rope(x, torch.zeros(3, device=DEVICE), inv_freq(8))
    with pytest.raises(ValueError, match="one per token"):
        triton_rope.rope(x, torch.zeros(4, dtype=torch.int32, device=DEVICE), inv_freq(8))
    with pytest.raises(ValueError, match="even"):
        triton_rope.rope(torch.randn(3, 2, 7, device=DEVICE),
                         torch.zeros(3, dtype=torch.int32, device=DEVICE), inv_freq(8))


def test_rope_append_fills_the_cache_and_refuses_bad_positions():
    g = generator(3, DEVICE)
    batch, seq, hq, hkv, d, capacity = 2, 3, 4, 2, 16, 8
    qkv = random_tensor((batch * seq, (hq + 2 * hkv) * d), torch.float32, DEVICE, g)
    k_cache = torch.zeros(batch, hkv, capacity, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([2, 3, 4, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    original = qkv.clone().view(batch * seq, hq + 2 * hkv, d)
    triton_rope.rope_append(qkv, positions, inv_freq(d), k_cache, v_cache, status, n_q_heads=hq,
                            n_kv_heads=hkv, batch=batch)
    heads = qkv.view(batch * seq, hq + 2 * hkv, d)
    rope_check(original[:, :hq], positions, inv_freq(d), heads[:, :hq], torch.float32)
    k_want = reference.rope_fp64(original[:, hq:hq + hkv], positions, inv_freq(d))
    for t in range(batch * seq):
        b, p = t // seq, int(positions[t])
        assert torch.allclose(k_cache[b, :, p].double(), k_want[t], atol=1e-5)
        assert torch.equal(v_cache[b, :, p], original[t, hq + hkv:])
    assert int(status) == 0
    # a position outside the cache: nothing written, the flag raised
    before_k, before_v = k_cache.clone(), v_cache.clone()
    bad = torch.tensor([capacity, -1, 0, 0, 0, capacity + 5], dtype=torch.int32, device=DEVICE)
    triton_rope.rope_append(qkv[[0, 1, 2, 3, 4, 5]].clone(), bad, inv_freq(d), k_cache, v_cache,
                            status, n_q_heads=hq, n_kv_heads=hkv, batch=batch)
    assert int(status) == triton_rope.STATUS_POSITION_OUT_OF_RANGE
    assert torch.equal(k_cache[0, :, 1:], before_k[0, :, 1:])  # only position 0 was rewritten
    assert torch.equal(k_cache[1, :, 1:], before_k[1, :, 1:])
    assert torch.equal(v_cache[:, :, 1:], before_v[:, :, 1:])


# ------------------------------------------------------------------------------------------------
# Argmax, embedding, SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 251), (2, 70001)])
def test_argmax_matches_torch_including_ties(dtype, shape):
    g = generator(4, DEVICE)
    logits = random_tensor(shape, dtype, DEVICE, g)
    rows, vocab = shape
    if vocab > 1:
        top = logits.max() + 1
        logits[0, vocab - 1] = top  # a tie: the first of the two must win
        logits[0, vocab // 2] = top
    if rows > 1 and vocab > 2:
        logits[1] = logits[1, 0]  # a whole row of equal values: index 0
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    triton_ops.argmax(logits, out=out)
    assert torch.equal(out.cpu(), torch.argmax(logits, dim=-1).cpu())


def test_argmax_rejects_bad_arguments():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        triton_ops.argmax(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_ops.argmax(torch.zeros(4, 6, device=DEVICE)[:, ::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_and_swiglu(dtype):
    g = generator(5, DEVICE)
    table = random_tensor((37, 100), dtype, DEVICE, g)
    ids = torch.tensor([[3, 36, 0], [5, 5, 11]], device=DEVICE)
    assert torch.equal(triton_ops.embedding(ids, table), table[ids])
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(triton_ops.embedding(ids, table, status=status), table[ids])
    assert int(status) == 0
    bad = torch.tensor([2, 37, 4, -1], device=DEVICE)
    rows = triton_ops.embedding(bad, table, status=status)
    assert int(status) == triton_ops.STATUS_TOKEN_OUT_OF_RANGE
    assert torch.equal(rows[0::2], table[bad[0::2]]) and not rows[1::2].any()
    gate_up = random_tensor((5, 2 * 201), dtype, DEVICE, g)
    out = poison_(torch.empty(5, 201, dtype=dtype, device=DEVICE))
    triton_ops.swiglu(gate_up, out=out)
    result = compare(out, reference.swiglu_fp64(gate_up), atol=1e-6, rtol=2 * ULP[dtype])
    assert result.ok, result.reason


# ------------------------------------------------------------------------------------------------
# Attention against the cache, positions read from the device


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q", [1, 3])
def test_cache_attention_matches_fp64(dtype, n_q):
    g = generator(6, DEVICE)
    batch, hq, hkv, d, capacity = 2, 6, 2, 32, 200
    # strided, as in the model
    q = random_tensor((batch, n_q, hq, d), dtype, DEVICE, g).transpose(1, 2)
    k = random_tensor((batch, hkv, capacity, d), dtype, DEVICE, g)
    v = random_tensor((batch, hkv, capacity, d), dtype, DEVICE, g)
    # sequence 0 at positions ending at 150 (splits of 64 keys: the last one partial),
    # sequence 1 at 2
    last = torch.tensor([150, n_q - 1 + 2 * (n_q == 1)])
    positions = (last[:, None] - n_q + 1 + torch.arange(n_q)).reshape(-1).to(torch.int32).to(DEVICE)
    out = poison_(torch.empty(batch, hq, n_q, d, dtype=dtype, device=DEVICE))
    ws = triton_attention.AttentionWorkspace(batch, hq, n_q, capacity, d, DEVICE)
    triton_attention.cache_attention(q, k, v, positions, out, ws, d ** -0.5)
    want = reference.attention_fp64(q, k, v, positions)
    result = compare(out, want, atol=2 * ULP[dtype], rtol=4 * ULP[dtype])
    assert result.ok, result.reason


# ------------------------------------------------------------------------------------------------
# The model against Hugging Face


@pytest.fixture(scope="module")
def tiny_fp32():
    hf = hf_reference.random_llama(TINY, seed=0)
    return hf, Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=48)


def prompt(config, batch, n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, n), generator=g)


def test_tiny_model_layer_by_layer_against_hf(tiny_fp32):
    hf, model = tiny_fp32
    tokens = prompt(TINY, 2, 11)
    ours = []
    logits = model.prefill(tokens.to(DEVICE), hidden_states=ours)
    hf_logits, theirs = hf_reference.hidden_states_by_layer(hf, tokens)
    assert len(ours) == len(theirs) == TINY.n_layers
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err = (a.cpu().double() - b.double()).abs().max() / b.double().abs().max()
        assert err < 1e-5, f"layer {i}: relative error {err:.2e}"
    assert reference.logits_error(logits.cpu(), hf_logits[:, -1]) < 1e-5
    # and the float64 spec of the same weights, within the stated tolerance
    want, _ = reference.forward_fp64(model.w, tokens.to(DEVICE))
    assert reference.logits_error(logits, want[:, -1]) < reference.LOGITS_TOLERANCE[torch.float32]


def test_tiny_model_greedy_generation_equals_hf_generate(tiny_fp32):
    hf, model = tiny_fp32
    tokens = prompt(TINY, 2, 5, seed=8)
    ours = model.generate(tokens.to(DEVICE), 32, graph=False)
    theirs = hf_reference.greedy(hf, tokens, 32)
    assert torch.equal(ours.cpu(), theirs)


def test_tiny_model_bf16_uses_module_03_attention():
    """bf16: prefill through FlashAttention-2, decode through flash-decoding, both against the fp64
    spec of the same weights."""
    hf = hf_reference.random_llama(TINY, seed=1, dtype=torch.bfloat16)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    tokens = prompt(TINY, 1, 6, seed=9).to(DEVICE)
    logits = model.prefill(tokens)
    want, _ = reference.forward_fp64(model.w, tokens)
    assert reference.logits_error(logits, want[:, -1]) < reference.LOGITS_TOLERANCE[torch.bfloat16]
    nxt = torch.argmax(logits, -1)
    step = model.decode_step(nxt)
    want, _ = reference.forward_fp64(model.w, torch.cat([tokens, nxt[:, None]], 1))
    assert reference.logits_error(step, want[:, -1]) < reference.LOGITS_TOLERANCE[torch.bfloat16]


def test_decode_step_takes_a_strided_column_of_tokens():
    """Tokens taken from a column of a (B, T) history are strided: the step must handle them."""
    hf = hf_reference.random_llama(TINY, seed=12)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=8)
    history = prompt(TINY, 2, 5).to(DEVICE)
    model.prefill(history[:, :4])
    strided = model.decode_step(history[:, 4])
    model.prefill(history[:, :4])
    assert torch.equal(strided, model.decode_step(history[:, 4].contiguous()))


def test_untied_weights_load_and_match_hf():
    config = DecoderConfig(**{**TINY.__dict__, "tie_embeddings": False, "n_layers": 1})
    hf = hf_reference.random_llama(config, seed=2)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=8)
    assert model.w.lm_head.data_ptr() != model.w.embed.data_ptr()
    tokens = prompt(config, 1, 4)
    hf_logits, _ = hf_reference.hidden_states_by_layer(hf, tokens)
    assert reference.logits_error(model.prefill(tokens.to(DEVICE)).cpu(), hf_logits[:, -1]) < 1e-5


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error, and the cache as it was


def test_prompt_longer_than_the_cache_is_refused(tiny_fp32):
    _, model = tiny_fp32
    model.prefill(prompt(TINY, 1, 4).to(DEVICE))
    cache_k = model.cache.k.clone()
    with pytest.raises(ValueError, match="exceed the cache"):
        model.prefill(prompt(TINY, 1, 49).to(DEVICE))
    with pytest.raises(ValueError, match="exceed the cache"):
        model.generate(prompt(TINY, 1, 40).to(DEVICE), 9)
    assert torch.equal(model.cache.k, cache_k) and model.cache.length == 4


def test_decoding_past_the_cache_is_refused():
    hf = hf_reference.random_llama(TINY, seed=3)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=6)
    token = torch.argmax(model.prefill(prompt(TINY, 1, 6).to(DEVICE)), -1)
    cache_k = model.cache.k.clone()
    with pytest.raises(ValueError, match="exceed the cache"):
        model.decode_step(token)
    assert torch.equal(model.cache.k, cache_k) and model.cache.length == 6


def test_bad_token_ids_and_batches_are_refused(tiny_fp32):
    _, model = tiny_fp32
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 251\)"):
        model.prefill(torch.tensor([[1, 251]]))  # ids on the host: checked before any launch
    with pytest.raises(ValueError, match="batch <= 2"):
        model.prefill(torch.zeros(3, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="int32/int64"):
        model.prefill(torch.zeros(1, 2, device=DEVICE))
    # a bad id in a decode step (on the device: not read back) is flagged, not silently embedded
    model.prefill(torch.tensor([[1, 2]], device=DEVICE))
    model.check_status()
    model.decode_step(torch.tensor([251], device=DEVICE))
    with pytest.raises(RuntimeError, match=r"token id outside \[0, 251\)"):
        model.check_status()
    model.reset()


def test_weights_of_another_shape_or_dtype_are_refused():
    hf = hf_reference.random_llama(TINY, seed=4)
    state = dict(hf.state_dict())
    inv = torch.ones(TINY.head_dim // 2)
    other = DecoderConfig(**{**TINY.__dict__, "intermediate_size": 256})
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(200, 96\), the config "
                                         r"needs \(256, 96\)"):
        DecoderWeights.from_state_dict(other, state, inv)
    mixed = {**state, "model.norm.weight": state["model.norm.weight"].half()}
    with pytest.raises(TypeError, match="share one dtype"):
        DecoderWeights.from_state_dict(TINY, mixed, inv)
    missing = {k: v for k, v in state.items() if "layers.2." not in k}
    with pytest.raises(KeyError, match="model.layers.2"):
        DecoderWeights.from_state_dict(TINY, missing, inv)
    with pytest.raises(ValueError, match="inv_freq"):
        DecoderWeights.from_state_dict(TINY, state, torch.ones(5))


# ------------------------------------------------------------------------------------------------
# GPU: the 1B shape in bf16, the CUDA graph


@pytest.fixture(scope="module")
def llama_1b():
    hf = hf_reference.random_llama(LLAMA_1B, seed=0, dtype=torch.bfloat16, device="cuda")
    return hf, Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=256)


@pytest.mark.gpu
def test_1b_layer_by_layer_and_logits_against_hf(llama_1b):
    hf, model = llama_1b
    tokens = prompt(LLAMA_1B, 2, 64).cuda()
    ours = []
    logits = model.prefill(tokens, hidden_states=ours)
    hf_logits, theirs = hf_reference.hidden_states_by_layer(hf, tokens)
    errors = [float((a.float() - b.float()).norm() / b.float().norm())
              for a, b in zip(ours, theirs)]
    print("relative error per layer:", " ".join(f"{e:.4f}" for e in errors))
    assert max(errors) < 0.03  # bf16: both round every activation; differences stay at that level
    # Ours and HF's bf16 logits differed by up to 0.102 of their rms on the H100; both round every
    # activation, so the bar is HF's own bf16 error: against the same weights run in float32, ours
    # may be at most 1.5x as far off as HF's bf16 model is.
    hf32 = copy.deepcopy(hf).float()
    with torch.no_grad():
        exact = hf32(tokens).logits[:, -1]
    del hf32
    ours_err = reference.logits_error(logits, exact)
    hf_err = reference.logits_error(hf_logits[:, -1], exact)
    print(f"logits vs float32 HF: max error / rms = {ours_err:.4f} ours, {hf_err:.4f} HF bf16")
    assert ours_err <= 1.5 * hf_err


@pytest.mark.gpu
def test_1b_greedy_agrees_with_hf_generate_up_to_near_ties(llama_1b):
    """bf16 greedy decoding: HF's 32 tokens, fed to our decoder one by one (teacher forcing), must
    each be our greedy choice or within NEAR_TIE of our best logit; the free-running sequences are
    printed."""
    hf, model = llama_1b
    tokens = prompt(LLAMA_1B, 2, 64, seed=10).cuda()
    theirs = hf_reference.greedy(hf, tokens, 32)
    ours_free = model.generate(tokens, 32)
    logits = [model.prefill(tokens)]
    for t in range(64, 64 + 31):
        logits.append(model.decode_step(theirs[:, t]))
    logits = torch.stack(logits, 1).reshape(-1, LLAMA_1B.vocab_size)
    chosen = theirs[:, 64:].reshape(-1)
    margin = NEAR_TIE * float(logits.float().pow(2).mean().sqrt())
    exact = torch.argmax(logits, -1) == chosen
    ok = hf_reference.near_tie_agreement(logits, chosen, margin)
    print(f"greedy: {int(exact.sum())}/{exact.numel()} identical choices, the rest within "
          f"{margin:.3f} (near-ties); free-running sequences agree on "
          f"{float((ours_free[:, 64:] == theirs[:, 64:]).float().mean()):.0%} of tokens")
    assert ok.all()
    assert exact.float().mean() > 0.8


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode():
    """fp32: the eager step and the graph run the same kernels, so the sequences are identical."""
    hf = hf_reference.random_llama(TINY, seed=5, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=64)
    tokens = prompt(TINY, 2, 9).cuda()
    eager = model.generate(tokens, 40, graph=False)
    graphed = model.generate(tokens, 40, graph=True)
    assert torch.equal(eager, graphed)


@pytest.mark.gpu
def test_prefill_of_device_tokens_never_waits_for_the_gpu():
    """A prefill that read its ids back would stall the host behind the GPU, and a benchmark that
    queues work ahead of the call (bench.benchmark does) would time the host's launches too."""
    hf = hf_reference.random_llama(TINY, seed=7, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=16)
    tokens = prompt(TINY, 2, 9).cuda()
    bad = torch.tensor([[3, TINY.vocab_size]], device="cuda")
    model.prefill(tokens)  # compiles and autotunes, which synchronizes
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.prefill(tokens)
        model.prefill(bad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(RuntimeError, match="token id outside"):
        model.check_status()


@pytest.mark.gpu
def test_graph_refuses_a_position_past_the_cache():
    hf = hf_reference.random_llama(TINY, seed=6, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    step = model.capture_decode_graph(1)
    model.prefill(prompt(TINY, 1, 16).cuda())
    cache_k, cache_v = model.cache.k.clone(), model.cache.v.clone()
    step.start(torch.zeros(1, dtype=torch.int64, device="cuda"), 16)
    step.replay()
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        model.check_status()
    assert torch.equal(model.cache.k, cache_k) and torch.equal(model.cache.v, cache_v)


def test_benchmark_helpers_run_on_the_tiny_model(monkeypatch):
    """The benchmark's parts that need no GPU (HF's eager step, our prefill, the host-time split,
    merging the two processes' rows, the targets) run on the tiny model: a GPU run is not the first
    place a typo in them shows."""
    from kernels.decoder import benchmark, benchmark_hf

    monkeypatch.setattr(benchmark, "CONFIG", TINY)
    monkeypatch.setattr(benchmark, "DTYPE", torch.float32)
    monkeypatch.setattr(benchmark, "STEPS", 2)
    monkeypatch.setattr(benchmark, "ROUNDS", 1)
    monkeypatch.setattr(benchmark_hf, "COMPILE_BUDGET_S", -1)  # no torch.compile here
    hf = hf_reference.random_llama(TINY, seed=13, device=runtime.DEVICE)  # where the benchmark runs
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=32)
    theirs = benchmark_hf.decode_hf(hf, 2, 9, [0.0])
    assert theirs["HF eager ms"] > 0 and "not measured" in theirs["HF static compiled"]
    ours = benchmark.prefill_ours(model, 1, 8, {"matmul_bf16_tflops": 1.0})
    merged = benchmark.merge([ours], [benchmark_hf.prefill_hf(hf, 1, 8)], ("batch", "tokens"))
    assert merged[0]["ours vs HF eager"] > 0
    host = benchmark.host_breakdown(model, batch=1, context=8, steps=1)
    assert host["calls per step"]["rope_append"] == TINY.n_layers
    targets = benchmark.performance_targets(
        [{"batch": 1, "context": 9, "ours (graph) ms": 1.0, "ours % of floor": 90.0,
          "ours vs HF static compiled": 2.0}], merged, None)
    assert [t["met"] for t in targets][:2] == [True, True]


@pytest.mark.gpu
def test_graph_survives_other_graphs_and_cleared_cublas_workspaces():
    """Graphs captured one after another, the earlier ones freed, then cuBLAS's workspaces cleared
    and the cache emptied (what torch.compile's CUDA graphs do around each recording): the last
    graph must still replay correctly. A graph that inherited a workspace from an earlier graph's
    memory pool reads freed memory here."""
    hf = hf_reference.random_llama(TINY, seed=14, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=2, max_seq=32)
    for batch in (1, 2, 1):
        step = model.capture_decode_graph(batch)
    tokens = prompt(TINY, 1, 5).cuda()
    want = model.generate(tokens, 6, graph=False)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    model.prefill(tokens)
    step.start(want[:, 5], 5)
    got = [step.replay().clone() for _ in range(5)]
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(got, 1), want[:, 6:])
