"""Lab 07: the decoder's own kernels -- RoPE at per-token positions and greedy argmax in Triton,
RoPE in CUDA C as extra credit. Both Triton kernels must capture in a CUDA graph (the decode step
replays them).

RoPE: a case's shape is (tokens, heads, head_dim); the inputs are x, positions (tokens,) int32 drawn
at random in [0, 8192) (neither sorted nor contiguous, as a batch of sequences at different lengths
has them) and inv_freq (head_dim / 2,) float32, Llama's 10000^(-2j / head_dim). Argmax: a case's
shape is (rows, vocab); every other row has its maximum planted a second time at a random place, so
ties are always tested.
"""
from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.decoder import cupy_rope, reference, triton_ops, triton_rope
from kernels.testing import ULP, random_tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_POSITION = 8192

# --------------------------------------------------------------------------------------------------
# rope(x, positions, inv_freq, out=None)

# head_dim 64 and 128 (Llama's), 24 and 80 (pairs not a power of two); 1, 37 and 129 tokens; 1-9
# heads
ROPE_CASES = tuple(Case(shape, dtype) for shape in ((1, 1, 64), (37, 3, 24), (129, 9, 80))
                   for dtype in FLOAT_DTYPES) + (
    Case((33, 8, 128), torch.bfloat16),
    # q and k as slices of a fused qkv buffer: strided tokens and heads (must be handled)
    Case((17, 4, 64), torch.bfloat16, "qkv_slice"),
    Case((17, 4, 64), torch.float32, "qkv_slice"),
    # a non-contiguous view (every other element of each tensor): reject it or handle it
    Case((9, 2, 32), torch.float32, "strided"),
) + runtime.pick(gpu=(Case((4099, 32, 128), torch.bfloat16),), cpu=())


def draw_rope_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed: more tokens than any fixed case (257-320 on a
    CPU, where a program a token is slow, over 1-4 heads; 8193-16384 over 1-32 on a GPU) and a
    head dim among Llama's and two that are not powers of two."""
    tokens = rng.randrange(*runtime.pick(gpu=(8193, 16385), cpu=(257, 321)))
    heads = rng.randrange(1, runtime.pick(gpu=33, cpu=5))
    return (Case((tokens, heads, rng.choice((24, 64, 80, 128))),
                 rng.choice(FLOAT_DTYPES)),)


def inv_freq(head_dim: int, device, theta: float = 10000.0) -> torch.Tensor:
    j = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    return 1.0 / theta ** (j / head_dim)


def _rope_inputs(shape, dtype, device, gen):
    tokens, _, head_dim = shape
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device, generator=gen,
                              dtype=torch.int32)
    return random_tensor(shape, dtype, device, gen), positions, inv_freq(head_dim, device)


def _rope_layout(layout, inputs):
    if layout != "qkv_slice":
        return inputs
    x, positions, freqs = inputs
    tokens, heads, head_dim = x.shape
    wide = torch.zeros(tokens, 3 * heads, head_dim, dtype=x.dtype, device=x.device)
    view = wide[:, heads:2 * heads]  # the k heads of a (q, k, v) row
    view.copy_(x)
    return view, positions, freqs


def _rope_reference(x, positions, freqs):
    return reference.rope_fp64(x, positions, freqs)


def _rope_tolerance(dtype):
    # one rounding to the dtype, and the float32 sine and cosine (a few ulp of float32) -- relative
    # to |x[j]| + |x[j + D/2]|, the size of the terms of each output (see _rope_scale)
    return 0.0, ULP[dtype] + 8 * ULP[torch.float32]


def _rope_scale(x, positions, freqs):
    half = x.shape[-1] // 2
    pair = x[..., :half].double().abs() + x[..., half:].double().abs()
    return torch.cat([pair, pair], dim=-1)


def interleaved_fp64(x, positions, freqs):
    """RoPE on the pairs (2j, 2j + 1): the RoPE paper's layout, not Llama's."""
    theta = (positions.float()[:, None] * freqs.float()[None, :]).double()[:, None, :]
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    out[..., 0::2] = even * theta.cos() - odd * theta.sin()
    out[..., 1::2] = odd * theta.cos() + even * theta.sin()
    return out


def _close(result, want, x) -> bool:
    scale = _rope_scale(x, None, None)
    return bool(((result.double() - want).abs() <= 0.02 * scale + 1e-6).all())


def _rope_diagnosis(output, result, want, bad, x, positions, freqs):
    if result.shape != x.shape or torch.isnan(result.double()).all():
        return ""
    if _close(result, interleaved_fp64(x, positions, freqs), x):
        return ("this rotates the interleaved pairs (2j, 2j + 1), the RoPE paper's layout; Llama's "
                "pairs are (j, j + head_dim / 2), as Hugging Face's rotate_half splits them")
    for shift in (1, -1):
        if _close(result, reference.rope_fp64(x, positions + shift, freqs), x):
            return (f"this is the rotation at positions{shift:+d}: positions are off by one "
                    "(use each token's position as given, starting from 0)")
    rows = bad.reshape(bad.shape[0], -1).any(dim=1)
    if rows.any() and not rows.all():
        first = int(rows.float().argmax())
        return (f"{int(rows.sum())} of {rows.numel()} tokens are wrong, the first token {first}: "
                "does every token read its own position (positions[token])?")
    return ""


def _course_rope(x, positions, freqs, out=None):
    return triton_rope.rope(x, positions, freqs, out=out)


def _torch_rope(x, positions, freqs, out=None):
    """Hugging Face's formulation: cos and sin tables, rotate_half, in the input's dtype."""
    theta = positions.float()[:, None] * freqs[None, :]
    emb = torch.cat([theta, theta], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rope_bytes(x, positions, freqs):
    return 2 * x.numel() * x.element_size() + positions.numel() * positions.element_size()


def _rope_function(name, backend, course_kernel, points, description, hint, extra_credit=False):
    return GradedFunction(
        name=name, points=points, backend=backend, description=description,
        make_inputs=_rope_inputs, prepare=_rope_layout, reference_fp64=_rope_reference,
        tolerance=_rope_tolerance, scale=_rope_scale, diagnose=_rope_diagnosis,
        course_kernel=course_kernel, torch_native=_torch_rope, bytes_moved=_rope_bytes,
        cases=ROPE_CASES, draw_cases=draw_rope_cases, input_names=("x", "positions", "inv_freq"),
        graph_capture=True,
        perf=(PerfConfig(f"{name}/bf16/16384x32x128", (16384, 32, 128), torch.bfloat16),),
        hint=hint, extra_credit=extra_credit,
    )


# --------------------------------------------------------------------------------------------------
# argmax(logits, out=None) -> int64 (rows,)

ARGMAX_CASES = tuple(Case(shape, dtype) for shape in ((1, 1), (3, 251), (4, 4097))
                     for dtype in FLOAT_DTYPES) + (
    Case((2, 128256), torch.bfloat16),  # Llama 3's vocabulary
    Case((5, 1000), torch.float32, "strided"),
) + runtime.pick(gpu=(Case((32, 128256), torch.bfloat16), Case((1, 200003), torch.float32)),
                 cpu=())


def draw_argmax_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed: a vocabulary above 2**17 (more than Llama 3's) in
    any dtype, and an odd vocabulary of a few thousand over more rows."""
    return (Case((rng.randrange(1, 4), rng.randrange(2**17 + 1, 2**18)), rng.choice(FLOAT_DTYPES)),
            Case((rng.randrange(5, 17), 2 * rng.randrange(500, 4000) + 1),
                 rng.choice(FLOAT_DTYPES)))


def _argmax_inputs(shape, dtype, device, gen):
    logits = random_tensor(shape, dtype, device, gen)
    rows, vocab = shape
    if vocab > 1:
        tied = torch.arange(0, rows, 2, device=device)
        where = torch.randint(0, vocab, (tied.numel(),), device=device, generator=gen)
        logits[tied, where] = logits[tied].max(dim=1).values  # a second maximum: a tie
        # The last row's one maximum in the last column: a kernel that stops short of the width
        # (a cap on the columns, a tail chunk left out) is wrong whatever the seed, not only when
        # a random maximum happens to fall past where it stopped.
        logits[-1, -1] = logits[-1].max() + 1
    return (logits,)


def _argmax_reference(logits):
    return torch.argmax(logits.double(), dim=-1).double()


def _argmax_outputs(shape, dtype):
    return (((shape[0],), torch.int64),)


def _exact(dtype):
    return 0.0, 0.0


def _argmax_scale(logits):
    return torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)


def _argmax_diagnosis(output, result, want, bad, logits):
    if result.shape != want.shape:
        return ""
    values = logits.double()
    got = result.long().clamp(0, logits.shape[1] - 1)
    picked = values.gather(1, got[:, None]).squeeze(1)
    is_max = picked == values.max(dim=1).values
    if bool(is_max[bad].all()):
        return ("the wrong rows pick a maximum, but not the first: ties must go to the lowest "
                "index, as torch.argmax breaks them (across the programs of a row too)")
    return ""


def _course_argmax(logits, out=None):
    return triton_ops.argmax(logits, out=out)


def _torch_argmax(logits, out=None):
    return torch.argmax(logits, dim=-1)


def _argmax_bytes(logits):
    return logits.numel() * logits.element_size() + logits.shape[0] * 8


LAB = LabSpec(
    id="07_decoder",
    title="Decoder: RoPE at per-token positions and greedy argmax (Triton; RoPE in CUDA C)",
    functions=(
        _rope_function(
            "rope", "triton", _course_rope, 4,
            "Triton: x (tokens, heads, head_dim) rotated at each token's position (half-split)",
            "theta = position * inv_freq in float32; pairs (j, j + head_dim / 2); strided tokens "
            "and heads (use the strides); mask the pairs past head_dim / 2"),
        GradedFunction(
            name="argmax", points=3, backend="triton",
            description="Triton: each row's index of its largest logit, the first among equals",
            make_inputs=_argmax_inputs, reference_fp64=_argmax_reference, tolerance=_exact,
            scale=_argmax_scale, output_shapes=_argmax_outputs, diagnose=_argmax_diagnosis,
            course_kernel=_course_argmax, torch_native=_torch_argmax, bytes_moved=_argmax_bytes,
            cases=ARGMAX_CASES, draw_cases=draw_argmax_cases, input_names=("logits",),
            graph_capture=True,
            perf=(PerfConfig("argmax/bf16/32x128256", (32, 128256), torch.bfloat16),),
            hint="tl.argmax(x, 0, tie_break_left=True) inside a chunk; across chunks, keep the "
                 "first chunk holding the largest value"),
        _rope_function(
            "rope_cuda", "cupy", cupy_rope.rope, 2,
            "CUDA C through CuPy (extra credit): the same rotation, one block per token",
            "reduce theta to [-pi, pi] before a fast sine (or use sincosf); pairs (j, j + D/2)",
            extra_credit=True),
    ),
)


# --------------------------------------------------------------------------------------------------
# The assembled decode step (checked in the lab, not graded by points)

STEP_PROMPT = (2, 7)  # (batch, prompt tokens)
STEP_TOKENS = runtime.pick(gpu=32, cpu=10)


def check_decode_step(decode_step) -> bool:
    """The student's decode step -- decode_step(model, tokens (B,) int64, positions (B,) int32) ->
    next tokens (B,) int64 -- on the tiny float32 Llama of the tests, against the course's Decoder:
    the greedy sequences must be identical; on a GPU the step is also captured in one CUDA graph and
    the graph, replayed with the positions advancing in device memory, must give the same sequence.
    Prints PASS/FAIL lines; returns whether everything passed."""
    from kernels.decoder import hf_reference
    from kernels.decoder.config import TINY
    from kernels.decoder.model import Decoder, DecoderWeights

    device = runtime.DEVICE
    hf = hf_reference.random_llama(TINY, seed=11, device=device)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=STEP_PROMPT[0], max_seq=48)
    gen = torch.Generator(device="cpu").manual_seed(12)
    prompt = torch.randint(0, TINY.vocab_size, STEP_PROMPT, generator=gen).to(device)
    want = model.generate(prompt, STEP_TOKENS, graph=False)
    n = STEP_PROMPT[1]

    def run(step) -> torch.Tensor:
        model.prefill(prompt)
        tokens = want[:, n].clone()
        positions = torch.full((STEP_PROMPT[0],), n, dtype=torch.int32, device=device)
        got = [tokens]
        for _ in range(STEP_TOKENS - 1):
            tokens = step(tokens, positions).clone()
            positions += 1
            got.append(tokens)
        return torch.stack(got, 1)

    try:
        got = run(lambda t, p: decode_step(model, t, p))
    except NotImplementedError:
        print("NOT IMPLEMENTED  decode_step (and the rope and argmax it calls)")
        return False
    same = torch.equal(got, want[:, n:])
    first = int((got != want[:, n:]).any(0).float().argmax()) if not same else None
    print(f"{'PASS' if same else 'FAIL'}  decode_step: {STEP_TOKENS} greedy tokens of 2 sequences "
          f"{'equal' if same else f'differ from step {first} on from'} the course's decoder's")
    if not same or not runtime.ON_GPU:
        if same:
            print("CUDA graph: checked on a GPU only")
        return same
    tokens = torch.zeros(STEP_PROMPT[0], dtype=torch.int64, device=device)
    positions = torch.zeros(STEP_PROMPT[0], dtype=torch.int32, device=device)
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step(model, tokens, positions)  # warm-up: compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        # cuBLAS's workspace made in this graph's own memory pool (kernels/decoder/model.py,
        # DecodeGraph, says why)
        torch._C._cuda_clearCublasWorkspaces()
        with torch.cuda.graph(graph):
            captured = decode_step(model, tokens, positions)
        torch._C._cuda_clearCublasWorkspaces()
    except Exception as exc:  # noqa: BLE001 - whatever the forbidden host sync raised
        print(f"FAIL  decode_step cannot be captured in a CUDA graph ({type(exc).__name__}: "
              f"{exc}): a host sync (.item(), .cpu(), int(tensor), a size read from a tensor)?")
        return False

    def replay(t, p):
        tokens.copy_(t)
        positions.copy_(p)
        graph.replay()
        return captured

    same = torch.equal(run(replay), want[:, n:])
    print(f"{'PASS' if same else 'FAIL'}  decode_step captured once in a CUDA graph, replayed at "
          f"every position: {'the same tokens' if same else 'different tokens'}")
    return same
