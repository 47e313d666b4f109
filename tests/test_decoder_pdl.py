"""Programmatic dependent launch inside the decoder's graph step (kernels/decoder/pdl.py): the
default where the GPU has it, the same tokens and logits as the plain step, compiled in only there.

CPU: the flag is accepted and the interpreter runs the plain kernels (the same logits bit for bit,
GEMVs and fused GEMVs included); offline compiles for sm_90 (the PDL variants wait, the default
ones do not) and for sm_80 (the PDL request compiles to the plain kernel). GPU: 64 greedy tokens of
the graph with PDL equal the plain graph's and Hugging Face's, fp32 and bf16, batch 1 and 2."""

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
    assert pdl.launch_options(True) == {}
    assert pdl.launch_options(False) == {}


@pytest.mark.parametrize("pdl_flag", ["yes", 1, 0, "prefetch"])
def test_a_pdl_that_is_not_a_bool_is_refused(pdl_flag):
    hf = hf_reference.random_llama(TINY, seed=3)
    with pytest.raises(ValueError, match="pdl must be True, False or None"):
        Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16, pdl=pdl_flag)


def test_the_graph_takes_pdl_by_default_where_the_gpu_has_it(monkeypatch):
    """pdl=None (the default) asks the GPU; False turns it off everywhere."""
    weights = DecoderWeights.from_hf(hf_reference.random_llama(TINY, seed=3))
    assert Decoder(weights, max_batch=1, max_seq=16).pdl is pdl.available()
    monkeypatch.setattr(pdl, "available", lambda: True)
    assert Decoder(weights, max_batch=1, max_seq=16).pdl is True
    assert Decoder(weights, max_batch=1, max_seq=16, pdl=False).pdl is False
    monkeypatch.setattr(pdl, "available", lambda: False)
    assert Decoder(weights, max_batch=1, max_seq=16).pdl is False


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
    with_pdl = model.forward(token, positions, None, pdl=True)
    assert not torch.isnan(plain).any()
    assert torch.equal(plain, with_pdl)
    assert torch.equal(triton_ops.argmax(plain), triton_ops.argmax(with_pdl, pdl=True))


def test_every_triton_kernel_of_the_graph_step_asks_for_pdl(monkeypatch):
    """The chain is only as safe as its weakest link: with pdl=True every launch of the decoder's
    own Triton kernels in the step must ask for PDL (so that it waits before touching memory), with
    pdl=False none may. Counted per launch, bf16 with the GEMV and the fused GEMV in: per layer
    the fused qkv, RoPE + append, the attention (one or two launches), o, the fused gate_up and
    down; then lm_head's GEMV and the two argmax kernels' launch."""
    from kernels.decoder import triton_attention, triton_fused_gemv, triton_gemv, triton_rope

    asked = []

    def recording(with_pdl):
        asked.append(with_pdl)
        return {}

    for module in (triton_gemv, triton_fused_gemv, triton_rope, triton_attention, triton_ops):
        monkeypatch.setattr(module, "launch_options", recording)
    hf = hf_reference.random_llama(TINY, seed=3, dtype=torch.bfloat16)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    model.set_decode_linears(1, PROJECTIONS)
    model.set_decode_fused(1, ("qkv", "gate_up"))
    model.prefill(prompt(TINY, 1, 3).to(DEVICE))
    token = torch.ones((1, 1), dtype=torch.int64, device=DEVICE)
    positions = torch.full((1,), model.cache.length, dtype=torch.int32, device=DEVICE)
    counts = {}
    for with_pdl in (False, True):
        asked.clear()
        logits = model.forward(token, positions, None, pdl=with_pdl)
        triton_ops.argmax(logits, pdl=with_pdl)
        assert asked == [with_pdl] * len(asked)
        counts[with_pdl] = len(asked)
    assert counts[True] == counts[False] >= 6 * TINY.n_layers + 2


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
    from kernels.decoder.pdl_offline import KERNELS, compile_offline

    made = compile_offline("sm_90")
    assert {kernel for kernel, _ in made} == set(KERNELS)
    for (kernel, with_pdl), one in made.items():
        assert one["wait"] == int(with_pdl), (kernel, with_pdl, one)
        assert one["launch_dependents"] == int(with_pdl), (kernel, with_pdl, one)


@pytest.mark.cpu
def test_pdl_request_compiles_to_the_plain_kernel_for_an_a100():
    from kernels.decoder.pdl_offline import compile_offline

    made = compile_offline("sm_80", kernels=("skinny_linear_kernel", "rope_append_kernel"))
    for (kernel, with_pdl), one in made.items():
        assert one["target"] == "sm_80"
        assert one["wait"] == one["launch_dependents"] == 0, (kernel, with_pdl, one)


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
    models = {
        name: Decoder(weights, max_batch=batch, max_seq=96, pdl=name == "pdl")
        for name in ("default", "pdl")
    }
    for model in models.values():
        if gemv:
            model.set_decode_linears(batch, PROJECTIONS)
            model.set_decode_fused(batch, ("qkv", "gate_up"))
    tokens = prompt(TINY, batch, 9, seed=batch).cuda()
    theirs = hf_reference.greedy(hf, tokens, 64)
    default = models["default"].generate(tokens, 64, graph=True)
    mine = models["pdl"].generate(tokens, 64, graph=True)
    assert models["pdl"]._graph.pdl and not models["default"]._graph.pdl
    agree = float((mine == theirs).float().mean())
    print(f"{dtype} batch {batch} gemv {gemv}: PDL graph = HF on {agree:.1%} of tokens")
    assert torch.equal(mine, default)
    if not gemv:
        assert torch.equal(mine, theirs)


@pytest.mark.cpu
def test_benchmark_row_says_pdl_is_not_there():
    """Where PDL does not exist the benchmark's row says so instead of timing two equal graphs."""
    from kernels.decoder import benchmark

    hf = hf_reference.random_llama(TINY, seed=6)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    row = benchmark.decode_pdl(model, 1, 12, {"copy_gbps": 1.0})
    assert row["PDL"].startswith("not available") and "graph PDL ms" not in row
