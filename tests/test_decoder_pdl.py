"""Programmatic dependent launch inside the decoder's graph step (kernels/decoder/pdl.py): opt-in,
the same tokens and logits as the default step, compiled in only where the GPU has it; with
pdl="prefetch" the GEMVs also ask the L2 for their weights before the wait.

CPU: the flag is accepted and the interpreter runs the plain kernels (the same logits bit for bit,
GEMVs and fused GEMVs included); offline compiles for sm_90 (the PDL variants wait, the default
ones do not, the prefetch before the wait in the GEMVs' prefetch variants) and for sm_80 (the PDL
request compiles to the plain kernel). GPU: 64 greedy tokens of the graph with PDL, and with the
prefetch, equal the default graph's and Hugging Face's, fp32 and bf16, batch 1 and 2."""

import pytest
import torch

from kernels import runtime
from kernels.decoder import hf_reference, pdl, triton_ops
from kernels.decoder.config import PROJECTIONS, TINY
from kernels.decoder.model import Decoder, DecoderWeights
from tests.test_decoder import prompt

DEVICE = runtime.DEVICE
gpu = pytest.mark.gpu


@pytest.mark.cpu
def test_pdl_is_compiled_out_in_cpu_mode():
    """The interpreter can run neither griddepcontrol nor the launch attribute: pdl=True must
    give the plain launch, not the PDL constexpr."""
    assert not pdl.available()
    for mode in (False, True, pdl.PREFETCH):
        assert pdl.launch_options(mode) == pdl.launch_options(mode, weights=True) == {}


@pytest.mark.parametrize("mode", ["yes", 1, None, "PDL"])
def test_a_pdl_that_is_no_mode_is_refused(mode):
    hf = hf_reference.random_llama(TINY, seed=3)
    with pytest.raises(ValueError, match="pdl must be False, True or 'prefetch'"):
        Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16, pdl=mode)


def test_only_the_gemvs_take_the_prefetch_and_only_when_asked(monkeypatch):
    """On a GPU with PDL: every kernel gets the wait; PREFETCH goes to the GEMVs alone (the other
    kernels have no such constexpr), set for pdl="prefetch" only."""
    monkeypatch.setattr(pdl, "available", lambda: True)
    assert (
        pdl.launch_options(True)
        == pdl.launch_options(pdl.PREFETCH)
        == {
            "PDL": True,
            "launch_pdl": True,
        }
    )
    assert pdl.launch_options(True, weights=True)["PREFETCH"] is False
    assert pdl.launch_options(pdl.PREFETCH, weights=True)["PREFETCH"] is True
    assert pdl.launch_options(False, weights=True) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_step_with_pdl_gives_the_default_logits(dtype):
    """The graph's step (positions on the device, n_keys None: the cache attention) with and
    without pdl, from the same cache: the same logits and tokens, bit for bit. bf16 runs every
    projection through the course's GEMV and qkv, gate_up through the fused one."""
    hf = hf_reference.random_llama(TINY, seed=3, dtype=dtype)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16, pdl=True)
    assert model.pdl
    if dtype == torch.bfloat16:
        model.set_decode_linears(1, PROJECTIONS)
        model.set_decode_fused(1, ("qkv", "gate_up"))
    logits = model.prefill(prompt(TINY, 1, 5).to(DEVICE))
    token = triton_ops.argmax(logits).view(-1, 1)
    positions = torch.full((1,), model.cache.length, dtype=torch.int32, device=DEVICE)
    plain = model.forward(token, positions, None)
    assert not torch.isnan(plain).any()
    for mode in (True, pdl.PREFETCH):
        with_pdl = model.forward(token, positions, None, pdl=mode)
        assert torch.equal(plain, with_pdl)
        assert torch.equal(triton_ops.argmax(plain), triton_ops.argmax(with_pdl, pdl=mode))


def test_every_triton_kernel_of_the_graph_step_asks_for_pdl(monkeypatch):
    """The chain is only as safe as its weakest link: with pdl set every launch of the decoder's
    own Triton kernels in the step must ask for it (so that it waits before touching memory), with
    pdl=False none may; and the GEMVs, and only they, say that they take the prefetch. Counted per
    launch, bf16 with the GEMV and the fused GEMV in: per layer the fused qkv, RoPE + append, the
    attention (one or two launches), o, the fused gate_up and down; then lm_head's GEMV and the
    two argmax kernels' launch."""
    from kernels.decoder import triton_attention, triton_fused_gemv, triton_gemv, triton_rope

    asked = []

    def recording(module):
        def launch_options(with_pdl, weights=False):
            asked.append((module.__name__.rsplit(".", 1)[1], with_pdl, weights))
            return {}

        return launch_options

    for module in (triton_gemv, triton_fused_gemv, triton_rope, triton_attention, triton_ops):
        monkeypatch.setattr(module, "launch_options", recording(module))
    hf = hf_reference.random_llama(TINY, seed=3, dtype=torch.bfloat16)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    model.set_decode_linears(1, PROJECTIONS)
    model.set_decode_fused(1, ("qkv", "gate_up"))
    model.prefill(prompt(TINY, 1, 3).to(DEVICE))
    token = torch.ones((1, 1), dtype=torch.int64, device=DEVICE)
    positions = torch.full((1,), model.cache.length, dtype=torch.int32, device=DEVICE)
    counts = {}
    for mode in (False, True, pdl.PREFETCH):
        asked.clear()
        logits = model.forward(token, positions, None, pdl=mode)
        triton_ops.argmax(logits, pdl=mode)
        assert {with_pdl for _, with_pdl, _ in asked} == {mode}
        gemvs = [name for name, _, weights in asked if weights]
        assert set(gemvs) == {"triton_gemv", "triton_fused_gemv"}
        assert all(weights for name, _, weights in asked if name in gemvs)
        assert len(gemvs) == 4 * TINY.n_layers + 1  # qkv, o, gate_up, down a layer; lm_head
        counts[mode] = len(asked)
    assert counts[True] == counts[pdl.PREFETCH] == counts[False] >= 6 * TINY.n_layers + 2


def test_decoder_with_pdl_generates_the_default_tokens():
    hf = hf_reference.random_llama(TINY, seed=4)
    weights = DecoderWeights.from_hf(hf)
    tokens = prompt(TINY, 1, 4, seed=5).to(DEVICE)
    plain = Decoder(weights, max_batch=1, max_seq=16).generate(tokens, 6)
    with_pdl = Decoder(weights, max_batch=1, max_seq=16, pdl=True).generate(tokens, 6)
    assert torch.equal(plain, with_pdl)


# ------------------------------------------------------------------------------------------------
# Compiled without a GPU: the wait is in the PDL variants for Hopper, and nowhere for an A100


@pytest.mark.cpu
def test_pdl_variants_wait_on_hopper_and_default_ones_do_not():
    """And the GEMVs' prefetch variants prefetch (once a weight, twice for gate and up), before
    the wait; nothing else does."""
    from kernels.decoder.pdl_offline import GEMVS, KERNELS, compile_offline

    made = compile_offline("sm_90")
    assert {kernel for kernel, _ in made} == set(KERNELS)
    assert {kernel for kernel, mode in made if mode == pdl.PREFETCH} == set(GEMVS)
    for (kernel, mode), one in made.items():
        assert one["wait"] == int(bool(mode)), (kernel, mode, one)
        assert one["launch_dependents"] == int(bool(mode)), (kernel, mode, one)
        assert (one["prefetch"] > 0) == (mode == pdl.PREFETCH), (kernel, mode, one)
        assert one["prefetch_before_wait"] == (mode == pdl.PREFETCH), (kernel, mode, one)


@pytest.mark.cpu
def test_pdl_request_compiles_to_the_plain_kernel_for_an_a100():
    from kernels.decoder.pdl_offline import compile_offline

    made = compile_offline("sm_80", kernels=("skinny_linear_kernel", "rope_append_kernel"))
    assert ("skinny_linear_kernel", pdl.PREFETCH) in made
    for (kernel, mode), one in made.items():
        assert one["target"] == "sm_80"
        assert one["wait"] == one["launch_dependents"] == one["prefetch"] == 0, (kernel, mode, one)


# ------------------------------------------------------------------------------------------------
# On the GPU: the graph with PDL against the default graph and Hugging Face


GPU_CASES = [
    pytest.param(dtype, batch, gemv, id=f"{dtype}-{batch}" + ("-gemv" if gemv else ""))
    for dtype in [torch.float32, torch.bfloat16]
    for batch in [1, 2]
    for gemv in ([False, True] if dtype == torch.bfloat16 else [False])
]


@gpu
@pytest.mark.parametrize("dtype, batch, gemv", GPU_CASES)
def test_gpu_graph_with_pdl_equals_the_default_graph_and_hf(dtype, batch, gemv):
    """`gemv`: every projection through the course's GEMV, qkv and gate_up fused with their norm
    (the batch-1 choice on the H200), so that PDL runs GEMV to GEMV; the sequences must equal
    the default graph's with the same choice, and Hugging Face's (cuBLAS's rounding) where the
    projections are cuBLAS's."""
    hf = hf_reference.random_llama(TINY, seed=5, dtype=dtype, device="cuda")
    weights = DecoderWeights.from_hf(hf)
    modes = {"default": False, "pdl": True, "prefetch": pdl.PREFETCH}
    models = {
        name: Decoder(weights, max_batch=batch, max_seq=96, pdl=mode)
        for name, mode in modes.items()
    }
    for model in models.values():
        if gemv:
            model.set_decode_linears(batch, PROJECTIONS)
            model.set_decode_fused(batch, ("qkv", "gate_up"))
    tokens = prompt(TINY, batch, 9, seed=batch).cuda()
    theirs = hf_reference.greedy(hf, tokens, 64)
    made = {name: model.generate(tokens, 64, graph=True) for name, model in models.items()}
    assert {name: model._graph.pdl for name, model in models.items()} == modes
    for name in ("pdl", "prefetch"):
        agree = float((made[name] == theirs).float().mean())
        print(f"{dtype} batch {batch} gemv {gemv}: {name} graph = HF on {agree:.1%} of tokens")
        assert torch.equal(made[name], made["default"])
        if not gemv:
            assert torch.equal(made[name], theirs)


@pytest.mark.cpu
def test_benchmark_row_says_pdl_is_not_there():
    """Where PDL does not exist the benchmark's row says so instead of timing two equal graphs."""
    from kernels.decoder import benchmark

    hf = hf_reference.random_llama(TINY, seed=6)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    row = benchmark.decode_pdl(model, 1, 12, {"copy_gbps": 1.0})
    assert row["PDL"].startswith("not available") and "graph PDL ms" not in row
