"""Known-wrong chunked cross-entropy submissions (lab 05), and what the grader must say.

Each is the lab's `token_losses` with one mistake a student makes."""

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.memory_profiling.validate import check_linear_ce_args

BLOCK_T, BLOCK_V, BLOCK_H = 64, 256, 64


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    tokens,
    vocab,
    hidden,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The full (tokens, vocab) logits, written to global memory."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        xb = tl.load(
            x_ptr + toks[:, None] * hidden + h0 + hs[None, :],
            mask=(toks[:, None] < tokens) & (h0 + hs[None, :] < hidden),
            other=0.0,
        ).to(tl.float32)
        wb = tl.load(
            w_ptr + vs[:, None] * hidden + h0 + hs[None, :],
            mask=(vs[:, None] < vocab) & (h0 + hs[None, :] < hidden),
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(xb, tl.trans(wb), input_precision="ieee")
    tl.store(
        z_ptr + toks[:, None] * vocab + vs[None, :],
        acc,
        mask=(toks[:, None] < tokens) & (vs[None, :] < vocab),
    )


@triton.jit
def _loss_kernel(
    z_ptr,
    t_ptr,
    loss_ptr,
    tokens,
    vocab,
    ignore_index,
    BLOCK_V: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    """Online log-sum-exp over one row of stored logits."""
    row = tl.program_id(0)
    target = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    end = (
        vocab - BLOCK_V if MISTAKE == "off_by_one_chunk" else vocab
    )  # the last (partial) chunk is skipped
    for v0 in range(0, end, BLOCK_V):
        z = tl.load(z_ptr + row * vocab + v0 + cols, mask=v0 + cols < vocab, other=float("-inf"))
        new_m = tl.maximum(m, z)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe) + tl.exp(z - safe)
        m = new_m
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    zt = tl.load(z_ptr + row * vocab + tl.where(target == ignore_index, 0, target))
    loss = tl.where(target == ignore_index, 0.0, lse - zt)
    tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))


def submission(mistake: str):
    """ "full_logits": right values, but the (tokens, vocab) logits are stored in float32
    between two kernels.
    "off_by_one_chunk": the same, and the loop over vocabulary chunks stops one chunk early."""

    def token_losses(x, w, targets, ignore_index=-100, out=None):
        check_linear_ce_args("token_losses", x, w, targets, device_type=runtime.DEVICE)
        tokens, hidden = x.shape
        vocab = w.shape[0]
        out = torch.empty(tokens, dtype=x.dtype, device=x.device) if out is None else out
        logits = torch.empty(tokens, vocab, dtype=torch.float32, device=x.device)
        _logits_kernel[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(vocab, BLOCK_V))](
            x, w, logits, tokens, vocab, hidden, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H
        )
        _loss_kernel[(tokens,)](
            logits, targets, out, tokens, vocab, ignore_index, BLOCK_V=BLOCK_V, MISTAKE=mistake
        )
        return out

    return token_losses


# what check_function's message must contain (GPU and CPU), and on a GPU only
CORPUS = {"off_by_one_chunk": "1 float32: n=1: 1 of 1 elements wrong"}
# (the first case over budget is 100 tokens x vocab 4099: 1.6 MiB of float32 logits against the 1
# MiB floor)
GPU_ONLY = {
    "full_logits": "MiB of device memory beyond its inputs and outputs at its peak; the budget is"
}


# --------------------------------------------------------------------------------------------------
# The lab's streaming kernel (one program per BLOCK_T tokens, the vocabulary in chunks, the online
# log-sum-exp), with mistakes that every fixed case lets through and a class of drawn cases catches.

STREAM_BLOCK_V = runtime.pick(gpu=128, cpu=256)


@triton.jit
def _streaming_kernel(
    x_ptr,
    w_ptr,
    t_ptr,
    loss_ptr,
    tokens,
    vocab,
    hidden,
    ignore_index,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < tokens
    targets = tl.load(t_ptr + toks, mask=tok_ok, other=ignore_index)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    zt = tl.zeros((BLOCK_T,), tl.float32)
    hs = tl.arange(0, BLOCK_H)
    v_end = vocab
    if MISTAKE == "skips_last_full_vocab_chunk":
        # full chunks up to vocab - BLOCK_V, then a masked tail chunk, empty when vocab is a
        # multiple of BLOCK_V: the last full chunk is never seen
        v_end = tl.where(vocab % BLOCK_V == 0, vocab - BLOCK_V, vocab)
    if MISTAKE == "vocab_past_32768_ignored":
        v_end = tl.minimum(vocab, 32768)
    h_end = hidden
    if MISTAKE == "hidden_past_1024_ignored":  # one tile of at most 1024 columns of x
        h_end = tl.minimum(hidden, 1024)
    for v0 in range(0, v_end, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        z = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for h0 in range(0, h_end, BLOCK_H):
            xb = tl.load(
                x_ptr + toks[:, None].to(tl.int64) * hidden + h0 + hs[None, :],
                mask=tok_ok[:, None] & (h0 + hs[None, :] < hidden),
                other=0.0,
            ).to(tl.float32)
            wb = tl.load(
                w_ptr + vs[:, None].to(tl.int64) * hidden + h0 + hs[None, :],
                mask=(vs[:, None] < vocab) & (h0 + hs[None, :] < hidden),
                other=0.0,
            ).to(tl.float32)
            z += tl.dot(xb, tl.trans(wb), input_precision="ieee")
        z = tl.where(vs[None, :] < vocab, z, float("-inf"))
        new_m = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m[:, None]), axis=1)
        m = new_m
        zt += tl.sum(tl.where(vs[None, :] == targets[:, None], z, 0.0), axis=1)
    ignored = targets == ignore_index
    if MISTAKE == "ignore_index_always_minus_100":
        ignored = targets == -100
    loss = tl.where(ignored, 0.0, m + tl.log(s) - zt)
    tl.store(loss_ptr + toks, loss.to(loss_ptr.dtype.element_ty), mask=tok_ok)


def streaming_submission(mistake: str):
    def token_losses(x, w, targets, ignore_index=-100, out=None):
        check_linear_ce_args("token_losses", x, w, targets, device_type=runtime.DEVICE)
        tokens = x.shape[0]
        out = torch.empty(tokens, dtype=x.dtype, device=x.device) if out is None else out
        programs = triton.cdiv(tokens, BLOCK_T)
        if mistake == "skips_last_full_token_block" and tokens % BLOCK_T == 0:
            programs -= 1  # the tail program, empty when BLOCK_T divides the tokens
        if programs:
            _streaming_kernel[(programs,)](
                x, w, targets, out, tokens, w.shape[0], x.shape[1], ignore_index,
                BLOCK_T=BLOCK_T, BLOCK_V=STREAM_BLOCK_V, BLOCK_H=BLOCK_H, MISTAKE=mistake,
            )
        return out

    return token_losses


# mistake -> (the index of the class among the drawn cases that catches it, what the grader says)
DRAWN_CORPUS = {
    "skips_last_full_token_block": (0, "NaN: elements never written"),
    "skips_last_full_vocab_chunk": (1, "elements wrong"),
    "hidden_past_1024_ignored": (2, "elements wrong"),
    "ignore_index_always_minus_100": (3, "elements wrong"),
}
# caught by the vocabulary above 2**16 that a GPU draws (lab05.large_vocabulary_case)
LARGE_VOCABULARY = ("vocab_past_32768_ignored", "elements wrong")


# --------------------------------------------------------------------------------------------------
# An attack on the grader, graded by `python -m grading` (what it forges is the worker's record):
# tests/test_grader_lab05.py::test_a_forged_memory_record_is_judged_on_the_memory_seen_from_outside

FORGES_THE_MEMORY_RECORD = """import sys

_worker = sys.modules["__main__"]
if hasattr(_worker, "record_to_dict"):
    _report = _worker.record_to_dict

    def _forged(record):
        if record.extra_bytes is not None:
            record.extra_bytes = 0
        return _report(record)

    _worker.record_to_dict = _forged
"""
# the (tokens, vocab) float32 logits: 512 MiB in the 4096-token case, whose budget is 32 MiB
HOLDS_THE_LOGITS = (
    "logits = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)\n"
)
OUTSIDE_REASON = "as the grading process saw it through NVML, outside the process that ran it"


def forged_memory_record():
    """The solution's kernel beside a buffer for the whole logits (what a kernel that stores them
    allocates), with the worker's record rewritten to say the call allocated nothing beyond its
    inputs and outputs: only the grading process's own reading of the worker's GPU memory sees
    it. A `Submission` of the lab as handed out, with this one function solved."""
    from tests.grader_corpus_generic import TARGETS
    from tests.grader_corpus_lab01 import PASS, Submission

    target = TARGETS["05_memory_profiling"]
    code = HOLDS_THE_LOGITS + target.solution.region("token_losses")
    return Submission(
        target.solution.solve_with("token_losses", code, FORGES_THE_MEMORY_RECORD),
        {"token_losses": ("fail", OUTSIDE_REASON)},
        cpu={"token_losses": PASS},
        gpu_only="memory budgets are checked on a GPU only",
    )
