"""Lab 06: the MoE layer's own kernels in Triton -- the router's top-k, the permutation, the grouped
GEMM; the grouped GEMM with SwiGLU fused into its epilogue as extra credit.

A case's shape holds the problem: (tokens, experts, top_k) for the router and the permutation, and
(tokens, experts, top_k, hidden, N) for the grouped GEMMs, whose weights are (experts, N, hidden).
The
scalars the function takes as arguments (top_k, experts) are also the case's params. Rows are padded
per expert to BLOCK_M, the lab's tile height, which the permutation pads to and the GEMM computes
in.

Routings: "contiguous" is each token's top_k of uniformly random expert scores; "skewed" sends 7 of
every 8 tokens to one expert as their first choice (the rest stay random); few tokens over many
experts leave most experts without a token. Every check except the graph capture runs in the
interpreter too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.moe import reference, triton_grouped_gemm, triton_permute, triton_router
from kernels.moe.triton_permute import Permutation, max_tiles, permute_reference
from kernels.testing import TINY, ULP

BLOCK_M = runtime.pick(
    gpu=64, cpu=16
)  # rows per GEMM tile: every expert's rows are padded to a multiple
HOT_EXPERT = 1  # the expert a "skewed" routing prefers
LOGIT_GAP = 0.75  # a token's logits are at least 0.5 apart (see _router_inputs)
FLOAT32_UNIT = 2.0**-24  # the unit roundoff of a float32 accumulator

# ------------------------------------------------------------------------------------------------
# Routings


def _random_ids(tokens: int, experts: int, top_k: int, device, gen) -> torch.Tensor:
    """(tokens, top_k) int64: each token's top_k distinct experts, uniformly at random, best
    first."""
    return torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=1).indices


def _skewed_ids(ids: torch.Tensor) -> torch.Tensor:
    """7 of every 8 tokens get HOT_EXPERT as their first choice (moved there if they had it
    already); each token's experts stay distinct."""
    ids = ids.clone()
    hot_first = torch.arange(ids.shape[0], device=ids.device) % 8 != 7
    has_hot = ids == HOT_EXPERT
    slot = has_hot.to(torch.int8).argmax(dim=1)  # where it is (0 if absent)
    swap = torch.nonzero(hot_first & has_hot.any(dim=1)).flatten()
    ids[swap, slot[swap]] = ids[swap, 0]
    ids[hot_first, 0] = HOT_EXPERT
    return ids


def _ids_of(sorted_ids: torch.Tensor, tile_expert: torch.Tensor, tokens: int) -> torch.Tensor:
    """The routing (tokens, top_k) a permutation was made from: row r holds assignment
    sorted_ids[r] of
    the expert of its tile."""
    real = sorted_ids >= 0
    expert_of_row = tile_expert.repeat_interleave(BLOCK_M)
    flat = torch.empty(int(real.sum()), dtype=torch.int64, device=sorted_ids.device)
    flat[sorted_ids[real].long()] = expert_of_row[real].long()
    return flat.view(tokens, -1)


def _moe_cases(shapes, dtypes, param: str, layout: str = "contiguous") -> tuple[Case, ...]:
    """Cases whose shape's entry `param` (experts: index 1, top_k: index 2) is also passed by
    name."""
    index = {"experts": 1, "top_k": 2}[param]
    return tuple(Case(s, d, layout, params=((param, s[index]),)) for s in shapes for d in dtypes)


# ------------------------------------------------------------------------------------------------
# route_topk(logits, top_k) -> (ids (tokens, top_k) int32, weights (tokens, top_k) float32)

ROUTER_CASES = (
    _moe_cases([(1, 8, 1)], [torch.float32], "top_k")  # one token, top-1: its weight is exactly 1
    + _moe_cases(
        [(37, 8, 2)], [torch.float32, torch.float16, torch.bfloat16], "top_k"
    )  # 37: no block's multiple
    + _moe_cases([(200, 16, 1)], [torch.bfloat16], "top_k")
    + _moe_cases([(100, 64, 2)], [torch.bfloat16], "top_k", "skewed")
    + _moe_cases(
        [(37, 8, 2)], [torch.float32], "top_k", "strided"
    )  # every other column: reject or handle
    + runtime.pick(
        gpu=_moe_cases([(4093, 32, 2), (4093, 128, 8)], [torch.bfloat16], "top_k"), cpu=()
    )
)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _drawn(shape, dtype, param: str, layout: str = "contiguous") -> Case:
    """One case whose scalar `param` (experts or top_k) is also passed by name, as _moe_cases."""
    return _moe_cases([shape], [dtype], param, layout)[0]


def draw_router_cases(rng) -> tuple[Case, ...]:
    """Routings drawn per run from the secret seed, one per class a wrong router can hide in:
    tokens a multiple of 128 (so of every BLOCK_T, 16 to 128), 128 to 512 of them (on a GPU 2176
    to 3968 over 64 experts: more than 2**17 logits; the interpreter would take 2 s); experts (67
    to 127, odd) and top_k (3, 5 or 6) that are not powers of two (the padded experts and slots
    must be masked); and logits whose rows lie in a wider buffer ("row stride": the lab promises
    strided rows with contiguous columns)."""
    blocks = rng.randrange(*runtime.pick(gpu=(17, 32), cpu=(1, 5)))
    return (
        _drawn((128 * blocks, 64, 2), rng.choice(DTYPES), "top_k"),
        _drawn((2 * rng.randrange(8, 50) + 1, 2 * rng.randrange(33, 64) + 1,
                rng.choice((3, 5, 6))), rng.choice(DTYPES), "top_k"),
        _drawn((2 * rng.randrange(8, 50) + 1, rng.choice((8, 16, 32)), rng.randrange(1, 3)),
               rng.choice(DTYPES), "top_k", "row stride"),
    )


def _router_inputs(shape, dtype, device, gen):
    """Logits whose values within a token are at least 2/3 of LOGIT_GAP (0.5) apart: a random
    permutation of evenly spaced values, each jittered by up to a third of a gap. |logit| <= 48 (128
    experts), where bfloat16's spacing is 0.25, so after rounding they stay 0.25 apart: no two
    experts tie, and no rounding of a correct kernel can swap two of them: the float64 reference's
    choice is the only right one."""
    tokens, experts, _ = shape
    order = torch.rand(tokens, experts, device=device, generator=gen).argsort(dim=1)
    jitter = torch.rand(tokens, experts, device=device, generator=gen) / 3
    logits = (order + jitter - experts / 2) * LOGIT_GAP
    return (logits.to(dtype),)


def _router_layout(layout, inputs):
    if layout == "row stride":  # the logits of a wider buffer: rows 24 elements further apart
        (logits,) = inputs
        tokens, experts = logits.shape
        wide = torch.empty(tokens, experts + 24, dtype=logits.dtype, device=logits.device)
        return (wide[:, :experts].copy_(logits),)
    if layout != "skewed":
        return inputs
    logits = inputs[0].clone()  # the hot expert's logit swapped with the token's largest
    rows = torch.nonzero(torch.arange(logits.shape[0], device=logits.device) % 8 != 7).flatten()
    best = logits[rows].argmax(dim=1)
    largest = logits[rows, best]
    logits[rows, best] = logits[rows, HOT_EXPERT]
    logits[rows, HOT_EXPERT] = largest
    return (logits,)


def _router_reference(logits, top_k):
    probs = torch.softmax(logits.double(), dim=1)
    top_p, ids = probs.topk(top_k, dim=1)
    return ids.double(), top_p / top_p.sum(dim=1, keepdim=True)


def _router_outputs(shape, dtype):
    tokens, _, top_k = shape
    return ((tokens, top_k), torch.int32), ((tokens, top_k), torch.float32)


def _router_tolerance(dtype):
    # The weights are float32 whatever the logits' dtype: exp of each chosen logit (the GPU's exp is
    # ex2.approx of a rounded product: 2 ulp, plus |l - max| * 2**-24 relative, at most 3 ulp here,
    # where a token's top 8 logits are within 6 of its largest), a sum of top_k terms, a division,
    # and two more roundings if the full softmax is normalized first -- within 16 ulp of float32.
    # Forgetting the renormalization is off by 1% or more. The ids must be exact (scale 0).
    return 0.0, 16 * 2.0**-23


def _router_scale(logits, top_k):
    ids, weights = _router_reference(logits, top_k)
    return torch.zeros_like(ids), weights.abs()


def _router_diagnosis(output, result, want, bad, logits, top_k):
    tokens = bad.shape[0]
    bad_tokens = torch.nonzero(bad.any(dim=1)).flatten()
    first = int(bad_tokens[0])
    # every token from a block boundary on (blocks are powers of two, 16 or more tokens), none
    # before
    if first and first % 16 == 0 and bad_tokens.numel() == tokens - first:
        unwritten = " (never written)" if _never_written(result[first:]) else ""
        # tokens a multiple of the block: the last block, a whole one, was skipped
        what = "wrong for tokens not a multiple of the block" if tokens % 16 else (
            "the last block of tokens was skipped")
        return (
            f"{what} (tokens={tokens}, first bad token "
            f"{first}): the last "
            f"{tokens - first} tokens are wrong{unwritten}; launch cdiv(tokens, BLOCK_T) programs "
            "and mask the "
            f"last one"
        )
    if output == "weights":
        chosen = _router_reference(logits, top_k)[
            0
        ].long()  # the ids were right: they are checked first
        probs = torch.softmax(logits.double(), dim=1).gather(1, chosen)
        if torch.allclose(result.double(), probs, rtol=1e-3, atol=0):
            return (
                f"these are the chosen experts' softmax probabilities (token {first}'s sum to "
                f"{float(result[first].double().sum()):.4f}, not 1): renormalize them, dividing "
                "each by their "
                f"sum over the top_k={top_k} chosen experts"
            )
    return ""


def _never_written(part: torch.Tensor) -> bool:
    """Still the grader's poison (kernels.testing.poison_): NaN, or an integer type's largest
    value."""
    if part.is_floating_point():
        return bool(torch.isnan(part).all())
    return bool((part == torch.iinfo(part.dtype).max).all())


_IDENTITY: dict = {}


def _course_router(logits, top_k, out=None):
    """The course's fused router (kernels/moe/triton_router.py) with the identity as the router
    matrix: its logits are then these logits, exactly (for timing; it also computes x @ I and writes
    the probs)."""
    key = (logits.shape[1], logits.dtype, logits.device)
    if key not in _IDENTITY:
        _IDENTITY[key] = torch.eye(logits.shape[1], dtype=logits.dtype, device=logits.device)
    _, ids, weights = triton_router.route(logits, _IDENTITY[key], top_k)
    return ids, weights


def _torch_router(logits, top_k, out=None):
    top_p, ids = torch.softmax(logits.float(), dim=1).topk(top_k, dim=1)
    return ids, top_p / top_p.sum(dim=1, keepdim=True)


def _router_bytes(logits, top_k):
    return logits.numel() * logits.element_size() + logits.shape[0] * top_k * 8


ROUTER = GradedFunction(
    name="route_topk",
    points=3,
    backend="triton",
    description="Triton: softmax over each token's expert logits, its top_k experts, their "
                "renormalized weights",
    make_inputs=_router_inputs,
    prepare=_router_layout,
    reference_fp64=_router_reference,
    tolerance=_router_tolerance,
    scale=_router_scale,
    n_outputs=2,
    output_names=("ids", "weights"),
    output_shapes=_router_outputs,
    diagnose=_router_diagnosis,
    course_kernel=_course_router,
    torch_native=_torch_router,
    bytes_moved=_router_bytes,
    cases=ROUTER_CASES,
    draw_cases=draw_router_cases,
    input_names=("logits",),
    graph_capture=True,
    own_kernels_only=True,
    perf=(
        PerfConfig("route_topk/bf16/32768x32x2", (32768, 32, 2), torch.bfloat16, (("top_k", 2),)),
    ),
    hint="softmax in float32 (subtract the row max); top_k rounds of 'take the largest, knock it "
         "out', ties to "
    "the lower expert id; divide the chosen probabilities by their sum",
)


# ------------------------------------------------------------------------------------------------
# permute(ids, experts) -> (counts, padded_offsets, sorted_ids, tile_expert, row_of), all int32

PERMUTE_OUTPUTS = ("counts", "padded_offsets", "sorted_ids", "tile_expert", "row_of")
PERMUTE_CASES = (
    _moe_cases([(1, 8, 1)], [torch.int32], "experts")
    + _moe_cases(
        [(37, 8, 2)], [torch.int32, torch.int64], "experts"
    )  # 74 assignments: no block's multiple
    + _moe_cases(
        [(5, 64, 2)], [torch.int32], "experts"
    )  # 10 assignments over 64 experts: most get none
    + _moe_cases([(100, 8, 2), (200, 16, 1)], [torch.int64], "experts", "skewed")
    + _moe_cases(
        [(37, 8, 2)], [torch.int32], "experts", "strided"
    )  # every other column: reject or handle
    # on a GPU a block holds 16384 / E assignments: 65534 and 240008 are multiples of none
    + runtime.pick(
        gpu=_moe_cases([(32767, 32, 2)], [torch.int32], "experts")
        + _moe_cases([(30001, 128, 8)], [torch.int64], "experts", "skewed"),
        cpu=(),
    )
)


def draw_permute_cases(rng) -> tuple[Case, ...]:
    """Routings drawn per run from the secret seed, one per class a wrong permutation can hide in:
    a number of assignments that is a multiple of 2048 (so of every block of assignments the lab
    and the course use: 64 and 256 in the interpreter, 16384 / E on a GPU; 2048 itself in the
    interpreter, up to 8192 on a GPU), top_k 1, 2 or 4 over 8 or 16 experts; experts that are not a
    power of two (9 to 127, odd: the padded experts must be masked); and more blocks of assignments
    than one step of the scan takes (4097 to 6144 assignments; on a GPU 2**17 to 2**18)."""
    long = runtime.pick(gpu=(2**16, 2**17), cpu=(2048, 3072))
    top_k = rng.choice((1, 2, 4))
    return (
        _drawn((2048 * runtime.pick(gpu=rng.randrange(1, 5), cpu=1) // top_k, rng.choice((8, 16)),
                top_k), rng.choice((torch.int32, torch.int64)), "experts"),
        _drawn((2 * rng.randrange(8, 100) + 1, 2 * rng.randrange(4, 64) + 1,
                rng.randrange(1, 5)), rng.choice((torch.int32, torch.int64)), "experts"),
        _drawn((rng.randrange(long[0] + 1, long[1] + 1), rng.choice((16, 32)), 2),
               rng.choice((torch.int32, torch.int64)), "experts", rng.choice(("contiguous",
                                                                               "skewed"))),
    )


def _permute_inputs(shape, dtype, device, gen):
    tokens, experts, top_k = shape
    return (_random_ids(tokens, experts, top_k, device, gen).to(dtype),)


def _permute_layout(layout, inputs):
    return (_skewed_ids(inputs[0]),) if layout == "skewed" else inputs


def _permute_outputs(shape, dtype):
    tokens, experts, top_k = shape
    tiles = max_tiles(tokens * top_k, experts, BLOCK_M)
    return tuple(
        ((n,), torch.int32) for n in (experts, experts + 1, tiles * BLOCK_M, tiles, tokens * top_k)
    )


def _permute_reference(ids, experts):
    perm = permute_reference(ids, experts, BLOCK_M)
    return tuple(getattr(perm, name).double() for name in PERMUTE_OUTPUTS)


def _exact(dtype):
    return 0.0, 0.0  # indices: exact


def _permute_diagnosis(output, result, want, bad, ids, experts):
    flat = ids.reshape(-1).long()
    n, top_k = flat.numel(), ids.shape[1]
    if output == "counts":
        counted = int(result.long().sum())
        if (
            counted < n
            and counted % 16 == 0
            and torch.equal(result.long(), torch.bincount(flat[:counted], minlength=experts))
        ):
            return (
                f"only the first {counted} of {n} assignments were counted (tokens={ids.shape[0]} "
                f"x top_k={top_k}; "
                f"first missing: assignment {counted}, token {counted // top_k}): the last "
                f"{'partial ' if n % 16 else ''}block was "
                f"dropped; launch cdiv(n, BLOCK) programs and mask the last one"
            )
    if output == "padded_offsets":
        unpadded = torch.cumsum(torch.bincount(flat, minlength=experts), 0)
        if torch.equal(result[1:].long(), unpadded.to(result.device)):
            return (
                f"each expert's rows must start at a multiple of BLOCK_M={BLOCK_M}: round every "
                "count up to a "
                "multiple of BLOCK_M before the prefix sum (back to back, one GEMM tile would "
                "hold two experts)"
            )
    if output in ("sorted_ids", "tile_expert"):
        first = int(torch.nonzero(bad.reshape(-1))[0])
        if bool((want[bad] == -1).all()):
            what = (
                "padding rows (past an expert's count in its last tile)"
                if output == "sorted_ids"
                else "tiles past the last expert's rows"
            )
            return (
                f"{what} must hold -1, which tells the GEMM there is nothing there (first: "
                f"{output}[{first}] = "
                f"{int(result.reshape(-1)[first])}); write -1 into them"
            )
        if output == "sorted_ids":
            real = want >= 0
            if bool((result[real].sort().values == want[real].sort().values).all()):
                return (
                    "every assignment is in its expert's rows, but not in order: within an "
                    "expert, rows must keep "
                    "the assignments' order (a prefix sum per block gives each its rank; atomics "
                    "do not)"
                )
    return ""


def _course_permute(ids, experts, out=None):
    return _permutation_tuple(triton_permute.permute(ids, experts, BLOCK_M))


def _torch_permute(ids, experts, out=None):
    return _permutation_tuple(permute_reference(ids, experts, BLOCK_M))


def _permutation_tuple(perm: Permutation) -> tuple:
    return tuple(getattr(perm, name) for name in PERMUTE_OUTPUTS)


def _permute_bytes(ids, experts):
    tiles = max_tiles(ids.numel(), experts, BLOCK_M)
    return ids.numel() * ids.element_size() + 4 * (
        2 * experts + 1 + tiles * BLOCK_M + tiles + ids.numel()
    )


PERMUTE = GradedFunction(
    name="permute",
    points=4,
    backend="triton",
    description="Triton: per-expert counts, padded offsets by prefix sum, the stable sorted "
                "order, the tile -> "
    "expert map, each assignment's row; no host synchronization",
    make_inputs=_permute_inputs,
    prepare=_permute_layout,
    reference_fp64=_permute_reference,
    tolerance=_exact,
    n_outputs=len(PERMUTE_OUTPUTS),
    output_names=PERMUTE_OUTPUTS,
    output_shapes=_permute_outputs,
    diagnose=_permute_diagnosis,
    course_kernel=_course_permute,
    torch_native=_torch_permute,
    bytes_moved=_permute_bytes,
    cases=PERMUTE_CASES,
    draw_cases=draw_permute_cases,
    input_names=("ids",),
    graph_capture=True,
    own_kernels_only=True,
    perf=(PerfConfig("permute/int32/32768x32x2", (32768, 32, 2), torch.int32, (("experts", 32),)),),
    hint="a histogram per block of assignments, one program for the prefix sums (per expert over "
         "the blocks, "
    "then the padded offsets over the experts), then each assignment's row = its expert's offset "
    "+ its "
    "block's start + its rank in the block; padding rows and unused tiles -1",
)


# ------------------------------------------------------------------------------------------------
# grouped_gemm(x, w, sorted_ids, tile_expert, top_k) -> c (rows, N): row r = x[sorted_ids[r] //
# top_k] @ w[tile_expert[r // BLOCK_M]].T, 0 in rows without an assignment. Extra credit:
# grouped_gemm_swiglu(x, w_gate, w_up, ...) -> silu(x_r @ w_gate[e].T) * (x_r @ w_up[e].T).

HIDDEN, N_OUT = 80, 96  # CPU: neither a multiple of 64; the interpreter's cost grows with the tiles
GEMM_SHAPES = [(37, 8, 2, HIDDEN, N_OUT)]


def _gemm_cases(dtypes, extra=()):
    return (
        _moe_cases(GEMM_SHAPES, dtypes, "top_k")
        + _moe_cases(
            [(1, 8, 1, HIDDEN, N_OUT)], [torch.bfloat16], "top_k"
        )  # one token: one tile, 7 experts idle
        + _moe_cases([(100, 8, 2, HIDDEN, N_OUT)], [torch.bfloat16], "top_k", "skewed")
        + tuple(extra)
        + runtime.pick(
            gpu=_moe_cases([(2048, 32, 2, 512, 1024)], [torch.bfloat16], "top_k")
            + _moe_cases([(2048, 32, 2, 512, 1024)], [torch.bfloat16], "top_k", "skewed"),
            cpu=(),
        )
    )


GEMM_CASES = _gemm_cases(
    [torch.bfloat16, torch.float16],
    extra=(
        _moe_cases(
            [(5, 64, 2, HIDDEN, N_OUT)], [torch.bfloat16], "top_k"
        )  # 10 rows over 64 experts: 54 idle
        # x a slice of a wider activation buffer: rows 128 elements apart
        + _moe_cases(GEMM_SHAPES, [torch.bfloat16], "top_k", "x row stride")
    ),
)
SWIGLU_CASES = _gemm_cases([torch.bfloat16, torch.float16])


def draw_gemm_cases(rng) -> tuple[Case, ...]:
    """Problems drawn per run from the secret seed, one per class a wrong grouped GEMM can hide in:
    hidden a multiple of 128 and N = 256 (every BLOCK_K and BLOCK_N the lab and the course use),
    with top_k 3 or 6 (not a power of two: token = sorted_ids // top_k); hidden above 1024, up
    to 4096 (the lab's timed width), for a few tokens; and on a GPU only, more than 2**17 output
    elements (1025 to 2048 tokens over 32 experts, N up to 2048: the interpreter would take
    minutes)."""
    cases = (
        _drawn((2 * rng.randrange(2, 8) + 1, 8, rng.choice((3, 6)), 128 * rng.randrange(1, 3),
                256), rng.choice((torch.bfloat16, torch.float16)), "top_k"),
        _drawn((rng.randrange(1, 6), 8, 1, 8 * rng.randrange(129, 513), 8 * rng.randrange(5, 8)),
               rng.choice((torch.bfloat16, torch.float16)), "top_k"),
    )
    if runtime.ON_GPU:
        cases += (_drawn((rng.randrange(1025, 2049), 32, 2, 256, 8 * rng.randrange(129, 257)),
                         torch.bfloat16, "top_k"),)
    return cases


def draw_swiglu_cases(rng) -> tuple[Case, ...]:
    """The grouped GEMM's classes for its fused extra credit, which shares their loops; in the
    interpreter only the first (multiples of every block, top_k 3 or 6): the wide hidden sizes
    cost it most, and the plain grouped GEMM has them."""
    cases = draw_gemm_cases(rng)
    return cases if runtime.ON_GPU else cases[:1]


SEED_SHAPE = (
    2048,
    32,
    2,
    4096,
    11008,
)  # the lecture's MoE configuration at 2048 tokens: the gate (or gate+up) GEMM


def _gemm_inputs(shape, dtype, device, gen, n_weights=1):
    tokens, experts, top_k, hidden, n = shape
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    # scaled like nn.Linear's weights, so every output is about unit size
    weights = [
        (torch.randn(experts, n, hidden, device=device, generator=gen) / hidden**0.5).to(dtype)
        for _ in range(n_weights)
    ]
    perm = permute_reference(_random_ids(tokens, experts, top_k, device, gen), experts, BLOCK_M)
    return (x, *weights, perm.sorted_ids, perm.tile_expert)


def _swiglu_inputs(shape, dtype, device, gen):
    return _gemm_inputs(shape, dtype, device, gen, n_weights=2)


def _gemm_layout(layout, inputs):
    x, *weights, sorted_ids, tile_expert = inputs
    if layout == "skewed":
        ids = _skewed_ids(_ids_of(sorted_ids, tile_expert, x.shape[0]))
        perm = permute_reference(ids, weights[0].shape[0], BLOCK_M)
        return (x, *weights, perm.sorted_ids, perm.tile_expert)
    if layout == "x row stride":
        wide = torch.empty(x.shape[0], x.shape[1] + 128, dtype=x.dtype, device=x.device)
        wide[:, : x.shape[1]] = x
        return (wide[:, : x.shape[1]], *weights, sorted_ids, tile_expert)
    return inputs


def _gemm_outputs(shape, dtype):
    tokens, experts, top_k, _, n = shape
    return (((max_tiles(tokens * top_k, experts, BLOCK_M) * BLOCK_M, n), dtype),)


def _per_expert(x, weights, sorted_ids, tile_expert, top_k, product):
    """float64 (rows, N): product(x_e, *w_e) in each row holding an assignment, 0 elsewhere."""
    n = weights[0].shape[1]
    out = torch.zeros(sorted_ids.numel(), n, dtype=torch.float64, device=x.device)
    expert_of_row = tile_expert.repeat_interleave(BLOCK_M)
    for e in range(weights[0].shape[0]):
        rows = torch.nonzero((expert_of_row == e) & (sorted_ids >= 0)).flatten()
        if rows.numel():
            out[rows] = product(
                x[sorted_ids[rows].long() // top_k].double(), *(w[e].double() for w in weights)
            )
    return out


def _gemm_reference(x, w, sorted_ids, tile_expert, top_k):
    return _per_expert(x, [w], sorted_ids, tile_expert, top_k, lambda a, b: a @ b.T)


def _accumulation_ulps(x):
    """A float32 sum of `hidden` products is within hidden * u of the sum of their magnitudes, in
    ulps of the output dtype (rtol is one of those): the allowance on top of the final rounding."""
    return x.shape[1] * FLOAT32_UNIT / ULP[x.dtype]


def _gemm_tolerance(dtype):
    return TINY[dtype], ULP[dtype]


def _gemm_scale(x, w, sorted_ids, tile_expert, top_k):
    """One rounding to the dtype (the interpreter truncates: a whole ulp) of the magnitude of the
    terms, |x| @ |w|.T, plus float32 accumulation; rows without an assignment must be exactly 0."""
    magnitude = _gemm_reference(x.abs(), w.abs(), sorted_ids, tile_expert, top_k)
    return magnitude * (1 + _accumulation_ulps(x))


def _swiglu_reference(x, w_gate, w_up, sorted_ids, tile_expert, top_k):
    return _per_expert(
        x,
        [w_gate, w_up],
        sorted_ids,
        tile_expert,
        top_k,
        lambda a, g, u: F.silu(a @ g.T) * (a @ u.T),
    )


def _swiglu_scale(x, w_gate, w_up, sorted_ids, tile_expert, top_k):
    """h = silu(g) * u, rounded once: one ulp of |h| (a whole one: the interpreter truncates;
    sigmoid's own float32 error is far below), plus the float32 errors of g and u carried through:
    |silu'| <= 1.1, so (1.1 |u| G + |silu(g)| U) times the accumulation allowance, G and U the
    magnitudes |x| @ |w|.T."""

    def terms(a, g, u):
        gate, up = a @ g.T, a @ u.T
        carried = reference.swiglu_carried_error(gate, up, a.abs() @ g.abs().T, a.abs() @ u.abs().T)
        return 2 * (F.silu(gate) * up).abs() + _accumulation_ulps(x) * carried

    return _per_expert(x, [w_gate, w_up], sorted_ids, tile_expert, top_k, terms)


def _gemm_diagnosis(output, result, want, bad, x, *rest, top_k):
    *_, sorted_ids, tile_expert = rest
    bad_rows = torch.nonzero(bad.any(dim=1)).flatten()
    bad_cols = torch.nonzero(bad.any(dim=0)).flatten()
    empty = sorted_ids[bad_rows] < 0
    if bool(empty.all()):
        row = int(bad_rows[0])
        held = float(result[row].abs().max())
        holds = (
            "was never written" if held != held else f"holds {held:.4g}"
        )  # NaN: the grader's poison
        if bool((tile_expert[bad_rows // BLOCK_M] < 0).all()):
            what, fix = (
                "rows of tiles past the end (tile_expert == -1)",
                "a program whose tile has expert -1 must still store its zeros",
            )
        else:
            what, fix = (
                "padding rows (sorted_ids == -1)",
                "mask the A loads of rows without an assignment (other=0)",
            )
        return (
            f"{what} must be 0, so that whatever reads whole tiles (the down projection, a weight "
            "gradient) "
            f"adds nothing: row {row} {holds}; {fix}"
        )
    n = want.shape[1]
    first = int(bad_cols[0])
    if first and first % 16 == 0 and bad_cols.numel() == n - first:
        return (
            f"columns {first} to {n - 1} of N={n} are wrong: the last column tile is never "
            "written or never masked; launch cdiv(N, BLOCK_N) column tiles and mask the last"
        )
    return ""


def _course_permutation(sorted_ids, tile_expert, top_k) -> Permutation:
    """What the course's grouped GEMM reads of a permutation (the rest is the combine's)."""
    return Permutation(
        counts=None,
        padded_offsets=None,
        sorted_ids=sorted_ids,
        tile_expert=tile_expert,
        row_of=None,
        block_m=BLOCK_M,
        top_k=top_k,
    )


# The course's kernels (kernels/moe/triton_grouped_gemm.py) for timing; their outputs are not
# checked (and they leave the rows of unused tiles unwritten), so they need not be copied into
# `out`.
def _course_gemm(x, w, sorted_ids, tile_expert, top_k, out=None):
    perm = _course_permutation(sorted_ids, tile_expert, top_k)
    return triton_grouped_gemm.grouped_gemm(x, w, w, perm, gather=True, swiglu=False)


def _course_swiglu(x, w_gate, w_up, sorted_ids, tile_expert, top_k, out=None):
    return triton_grouped_gemm.gate_up_swiglu(
        x, w_gate, w_up, _course_permutation(sorted_ids, tile_expert, top_k)
    )


def _torch_loop(x, weights, sorted_ids, tile_expert, top_k, product):
    """PyTorch's version: one expert at a time (the notebook's naive loop; it syncs with the
    host)."""
    out = torch.zeros(sorted_ids.numel(), weights[0].shape[1], dtype=x.dtype, device=x.device)
    expert_of_row = tile_expert.repeat_interleave(BLOCK_M)
    for e in range(weights[0].shape[0]):
        rows = torch.nonzero((expert_of_row == e) & (sorted_ids >= 0)).flatten()
        out[rows] = product(x[sorted_ids[rows].long() // top_k], *(w[e] for w in weights))
    return out


def _torch_gemm(x, w, sorted_ids, tile_expert, top_k, out=None):
    return _torch_loop(x, [w], sorted_ids, tile_expert, top_k, lambda a, b: a @ b.T)


def _torch_swiglu(x, w_gate, w_up, sorted_ids, tile_expert, top_k, out=None):
    return _torch_loop(
        x,
        [w_gate, w_up],
        sorted_ids,
        tile_expert,
        top_k,
        lambda a, g, u: F.silu(a @ g.T) * (a @ u.T),
    )


def _gemm_bytes(x, *rest, top_k):
    """Each token's row read once (the gathers hit L2), every weight read once, every row
    written."""
    *weights, sorted_ids, _ = rest
    rows = sorted_ids.numel() * weights[0].shape[1]
    return (x.numel() + sum(w.numel() for w in weights) + rows) * x.element_size()


def _gemm_flops(x, *rest, top_k):
    *weights, _, _ = rest
    return 2.0 * x.shape[0] * top_k * x.shape[1] * weights[0].shape[1] * len(weights)


GEMM = GradedFunction(
    name="grouped_gemm",
    points=5,
    backend="triton",
    description="Triton: one launch over every expert's tiles, the token gather fused into the A "
                "loads",
    make_inputs=_gemm_inputs,
    prepare=_gemm_layout,
    reference_fp64=_gemm_reference,
    tolerance=_gemm_tolerance,
    scale=_gemm_scale,
    output_shapes=_gemm_outputs,
    diagnose=_gemm_diagnosis,
    course_kernel=_course_gemm,
    torch_native=_torch_gemm,
    bytes_moved=_gemm_bytes,
    flops=_gemm_flops,
    cases=GEMM_CASES,
    draw_cases=draw_gemm_cases,
    input_names=("x", "w", "sorted_ids", "tile_expert"),
    graph_capture=True,
    own_kernels_only=True,
    perf=(
        PerfConfig(
            "grouped_gemm/bf16/2048x32x2x4096x11008", SEED_SHAPE, torch.bfloat16, (("top_k", 2),)
        ),
    ),
    hint="a program per (BLOCK_M-row tile, BLOCK_N columns); its expert from tile_expert (-1: "
         "write zeros); A rows "
    "gathered as x[sorted_ids // top_k], masked where sorted_ids < 0; accumulate in float32, "
    "round once",
)

SWIGLU = GradedFunction(
    name="grouped_gemm_swiglu",
    points=3,
    backend="triton",
    extra_credit=True,
    description="extra credit, Triton: the gate and up GEMMs in one kernel, SwiGLU in the epilogue",
    make_inputs=_swiglu_inputs,
    prepare=_gemm_layout,
    reference_fp64=_swiglu_reference,
    tolerance=_gemm_tolerance,
    scale=_swiglu_scale,
    output_shapes=_gemm_outputs,
    diagnose=_gemm_diagnosis,
    course_kernel=_course_swiglu,
    torch_native=_torch_swiglu,
    bytes_moved=_gemm_bytes,
    flops=_gemm_flops,
    cases=SWIGLU_CASES,
    draw_cases=draw_swiglu_cases,
    input_names=("x", "w_gate", "w_up", "sorted_ids", "tile_expert"),
    graph_capture=True,
    own_kernels_only=True,
    perf=(
        PerfConfig(
            "grouped_gemm_swiglu/bf16/2048x32x2x4096x11008",
            SEED_SHAPE,
            torch.bfloat16,
            (("top_k", 2),),
        ),
    ),
    hint="two float32 accumulators sharing each A tile; h = gate * sigmoid(gate) * up in float32, "
         "rounded once",
)

LAB = LabSpec(
    id="06_moe",
    title="MoE: the router's top-k, the token permutation and the grouped GEMM in Triton",
    functions=(ROUTER, PERMUTE, GEMM, SWIGLU),
)

# ------------------------------------------------------------------------------------------------
# The layer from the student's pieces: not graded (each piece is), the lab's last cell calls it.

LAYER_SHAPE = runtime.pick(
    gpu=(2048, 32, 2, 1024, 2816), cpu=(37, 8, 2, 64, 96)
)  # tokens, E, k, hidden, inter


def check_layer(route_topk, permute, grouped_gemm, grouped_gemm_swiglu=None) -> bool:
    """The MoE layer of notebook 06 from the student's functions (router GEMM and combine:
    PyTorch and the course's), against the float64 loop under the same routing; on a GPU also
    captured in a CUDA graph and replayed. Prints PASS/FAIL lines; returns whether everything
    passed."""
    from kernels.moe import reference, triton_combine
    from kernels.testing import compare, generator

    tokens, experts, top_k, hidden, inter = LAYER_SHAPE
    gen = generator(6, runtime.DEVICE)
    x = torch.randn(tokens, hidden, device=runtime.DEVICE, generator=gen).to(torch.bfloat16)
    w = reference.init_weights(experts, hidden, inter, torch.bfloat16, runtime.DEVICE, gen)

    def layer(fused: bool):
        ids, weights = route_topk(x.float() @ w.router.float().T, top_k)
        counts, offsets, sorted_ids, tile_expert, row_of = permute(ids, experts)
        if fused:
            h = grouped_gemm_swiglu(x, w.gate, w.up, sorted_ids, tile_expert, top_k)
        else:
            gate, up = (grouped_gemm(x, m, sorted_ids, tile_expert, top_k) for m in (w.gate, w.up))
            h = (F.silu(gate.float()) * up.float()).to(x.dtype)
        # the down projection's A rows are h's own rows: row r "gathers" row (r * top_k) // top_k
        in_order = torch.arange(sorted_ids.numel(), dtype=torch.int32, device=x.device) * top_k
        y = grouped_gemm(h, w.down, torch.where(sorted_ids >= 0, in_order, -1), tile_expert, top_k)
        perm = Permutation(counts, offsets, sorted_ids, tile_expert, row_of, BLOCK_M, top_k)
        return triton_combine.combine(y, weights, perm), ids, weights

    for fused in (True, False) if grouped_gemm_swiglu is not None else (False,):
        try:
            out, ids, weights = layer(fused)
            break
        except (
            NotImplementedError
        ):  # part 4 left out: gate and up unfused; parts 1-3 left out: nothing to run
            continue
    else:
        print("NOT IMPLEMENTED  the layer needs route_topk, permute and grouped_gemm")
        return False
    # h rounded to bf16 (twice more unfused: gate and up first), y and the output once each
    want = reference.moe_loop(x, w, top_k, fp64=True, ids=ids.long(), weights=weights)
    atol, rtol = reference.layer_tolerance(torch.bfloat16, fused=fused)
    cmp = compare(
        out, want, atol=atol, rtol=rtol, scale=reference.output_scale(x, w, ids.long(), weights)
    )
    how = "gate and up fused (part 4)" if fused else "gate and up unfused"
    print(
        f"{'PASS' if cmp.ok else 'FAIL'}  layer E={experts} top-{top_k}, {tokens} tokens, hidden "
        f"{hidden}, "
        f"inter {inter}, bf16, {how}: {cmp.reason or f'max abs err {cmp.max_abs_err:.2g}'}"
    )
    if not cmp.ok or not runtime.ON_GPU:
        if cmp.ok:
            print("CUDA graph: checked on a GPU only")
        return cmp.ok
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured, _, _ = layer(fused)
    except Exception as exc:  # noqa: BLE001 - whatever the forbidden host sync raised
        print(
            f"FAIL  the layer cannot be captured in a CUDA graph ({type(exc).__name__}: {exc}): a "
            "host sync "
            f"(.item(), .cpu(), int(tensor)) in one of the pieces?"
        )
        return False
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(captured, out)
    print(
        f"{'PASS' if same else 'FAIL'}  the layer captured in one CUDA graph and replayed: "
        f"{'the same output' if same else 'a different output'}"
    )
    return same
