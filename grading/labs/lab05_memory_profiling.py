"""Lab 05: the chunked cross-entropy forward in Triton (graded, with a GPU memory budget), and the
activation-memory estimator (checked in its own cell: against the course's estimator everywhere,
against
the measured peak on a GPU)."""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.memory_profiling import estimator, gpt, profiling, reference, triton_chunked_loss

# A fixed case's shape is (tokens,), the output's; its hidden size and vocabulary come from this
# table (a drawn case's shape is (tokens, hidden, vocab): draw_cases).
# Odd sizes, vocabularies that are not a multiple of any block, a token count not a multiple of
# BLOCK_T; on a GPU one large case, where materializing the logits (256 MiB) breaks the memory
# budget.
DIMS = {
    1: (16, 7),
    37: (48, 1500),
    65: (32, 1025),
    100: (64, 4099),
    4096: (1024, 32768),
    8192: (4096, 128256),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASES = (
    tuple(Case((t,), d) for t in (1, 37, 65) for d in DTYPES)
    + (Case((100,), torch.bfloat16), Case((37,), torch.float32, "strided"))
    + runtime.pick(gpu=(Case((4096,), torch.bfloat16),), cpu=())
)
IGNORED_EVERY = 7  # every 7th token (from the 3rd) carries no loss: ignore_index = -100


def draw_cases(rng) -> tuple[Case, ...]:
    """Problems drawn per run from the secret seed, one per class a wrong kernel can hide in; a
    drawn case's shape is (tokens, hidden, vocab):

    * tokens a multiple of 64 (BLOCK_T of the lab and the course's kernel): 192 to 512 of them
      (on a GPU 2112 to 4096: more than 2**17 elements in x);
    * a vocabulary that is a multiple of 256 (every BLOCK_V the lab and the course use), with an
      odd hidden size (its last BLOCK_H step partial);
    * a hidden size above 1024, up to 4096 (the lab's timed width): more than 2**17 elements in w;
    * an ignore_index of its own, drawn among the vocabulary's ids (a padding token's id), not
      -100: a kernel that compares with -100 whatever it is given ignores the wrong tokens;
    * on a GPU only, a vocabulary above 2**16, up to Llama 3's 128256 (the largest the lab times):
      the interpreter would take about 13 s (two calls of 330 to 500 vocabulary chunks).
    """
    cases = (
        Case((64 * rng.randrange(*runtime.pick(gpu=(33, 65), cpu=(3, 9))), 64,
              2 * rng.randrange(64, 128) + 1), rng.choice(DTYPES)),
        Case((2 * rng.randrange(1, 32) + 1, 2 * rng.randrange(16, 60) + 1,
              256 * rng.randrange(2, 9)), rng.choice(DTYPES)),
        Case((rng.randrange(1, 9), 8 * rng.randrange(129, 513), 2 * rng.randrange(65, 128) + 1),
             rng.choice(DTYPES)),
        ignore_index_case(rng),
    )
    if runtime.ON_GPU:
        cases += (large_vocabulary_case(rng),)
    return cases


def ignore_index_case(rng) -> Case:
    """A few tokens, some of them ignored through an ignore_index drawn among the vocabulary."""
    vocab = 2 * rng.randrange(64, 160) + 1
    return Case((rng.randrange(8, 40), 2 * rng.randrange(8, 32) + 1, vocab), rng.choice(DTYPES),
                params=(("ignore_index", rng.randrange(0, vocab)),))


def large_vocabulary_case(rng) -> Case:
    """A few tokens over a vocabulary above 2**16, up to 128256 (drawn on a GPU only)."""
    return Case((rng.randrange(1, 5), 16, rng.randrange(2**16 + 1, 128257)), rng.choice(DTYPES))


def _inputs(shape, dtype, device, gen, ignore_index=reference.IGNORE_INDEX):
    tokens = shape[0]
    hidden, vocab = DIMS[tokens] if len(shape) == 1 else shape[1:]
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    # scaled so logits are about N(0, 1), as in a trained model, not N(0, hidden)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    targets[3::IGNORED_EVERY] = ignore_index
    return x, w, targets


def _outputs(shape, dtype):
    return (((shape[0],), dtype),)  # one loss per token, in x's dtype


def _course(x, w, targets, out=None):
    return triton_chunked_loss.token_losses(x, w, targets, out=out)


def _torch(x, w, targets, out=None):
    return reference.token_losses(x, w, targets)


def _bytes(x, w, targets):
    return (
        x.numel() * x.element_size()
        + w.numel() * w.element_size()
        + targets.numel() * (8 + x.element_size())
    )


def _flops(x, w, targets):
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[0]


def _budget(x, w, targets, ignore_index=reference.IGNORE_INDEX):
    """An eighth of the (tokens, vocab) logits, and at least 1 MiB: a kernel that streams the
    vocabulary needs nothing beyond its output; one that stores the logits needs all of them. The
    case's ignore_index changes which losses are 0, not the memory."""
    return max(2**20, x.shape[0] * w.shape[0] * x.element_size() // 8)


LAB = LabSpec(
    id="05_memory_profiling",
    title="Memory: a chunked cross-entropy that never holds the logits, and predicting peak memory",
    functions=(
        GradedFunction(
            name="token_losses",
            points=6,
            backend="triton",
            description="Triton: per-token cross-entropy of x @ w.T, vocabulary in chunks (online "
                        "log-sum-exp)",
            make_inputs=_inputs,
            inputs_take_params=True,
            reference_fp64=reference.token_losses_fp64,
            tolerance=reference.token_losses_tolerance,
            course_kernel=_course,
            torch_native=_torch,
            bytes_moved=_bytes,
            flops=_flops,
            cases=CASES,
            draw_cases=draw_cases,
            output_shapes=_outputs,
            perf=(PerfConfig("token_losses/bf16/8192x4096x128256", (8192,), torch.bfloat16),),
            memory_budget=_budget,
            input_names=("x", "w", "targets"),
            hint="visit every vocabulary chunk (the last one is partial: mask it with -inf), "
                 "rescale the running "
            "sum when the maximum grows, and give ignored tokens (-100) a loss of 0",
        ),
    ),
)

# ------------------------------------------------------------------------------------------------
# The estimator's check: not a kernel, so not graded by the harness; the lab's check cell calls it.

ESTIMATOR_CONFIGS = (
    (gpt.GPT2_SMALL, 4, 1024),
    (gpt.GPT2_SMALL, 2, 512),
    (gpt.GPT2_XL, 1, 256),
    (gpt.GPTConfig(vocab=1000, max_seq=64, d_model=64, layers=2, heads=4), 4, 64),
)
ESTIMATOR_RTOL = 0.02  # against the course's estimator
MEASURED_RTOL = 0.10  # against the measured peak (GPU)


def check_estimator(fn) -> bool:
    """fn(batch, seq, d_model, layers, heads, vocab) -> predicted peak bytes of a full float32 AdamW
    step on a GPU. Prints PASS/FAIL lines; returns whether every check passed."""
    ok = True
    try:
        for cfg, batch, seq in ESTIMATOR_CONFIGS:
            want = estimator.estimate(
                gpt.GPTConfig(cfg.vocab, seq, cfg.d_model, cfg.layers, cfg.heads), batch, seq
            ).peak_step
            got = fn(batch, seq, cfg.d_model, cfg.layers, cfg.heads, cfg.vocab)
            good = abs(got - want) <= ESTIMATOR_RTOL * want
            ok &= good
            print(
                f"{'PASS' if good else 'FAIL'}  B={batch} T={seq} C={cfg.d_model} L={cfg.layers} "
                f"V={cfg.vocab}: "
                f"yours {got / 2**20:,.1f} MiB, course estimator {want / 2**20:,.1f} MiB"
            )
    except NotImplementedError:
        print("NOT IMPLEMENTED  estimate_peak_bytes: not implemented yet")
        return False
    if not runtime.ON_GPU:
        print(
            f"measured peak: {profiling.CPU_SOURCE} cannot stand for the GPU's allocator: checked "
            "on a GPU only"
        )
        return ok
    cfg, batch, seq = gpt.GPT2_SMALL, 4, 1024
    peak = measured_step_peak(cfg, batch, seq)
    got = fn(batch, seq, cfg.d_model, cfg.layers, cfg.heads, cfg.vocab)
    good = abs(got - peak) <= MEASURED_RTOL * peak
    print(
        f"{'PASS' if good else 'FAIL'}  GPT-2 small B={batch} T={seq} on the GPU: measured peak "
        f"{peak / 2**20:,.1f} MiB, yours {got / 2**20:,.1f} MiB ({100 * (got / peak - 1):+.1f}%; "
        "10% allowed)"
    )
    return ok and good


def measured_step_peak(cfg, batch, seq, dtype=torch.float32) -> int:
    """Peak bytes allocated over a steady-state AdamW step of gpt.GPT(cfg) (the second step),
    on a GPU."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what the rest of the process holds is not the model's
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(cfg.vocab, seq, cfg.d_model, cfg.layers, cfg.heads)).to(
        "cuda", dtype
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx, tg = gpt.make_batch(model.cfg, batch, seq, "cuda")
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(idx, tg).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model, opt
    torch.cuda.empty_cache()
    return peak
