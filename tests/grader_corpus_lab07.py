"""Known-wrong RoPE and argmax submissions (lab 07), as plain Triton functions, and what the grader
must say.

Each is the lab's `rope` or `argmax` with one mistake a student makes."""
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder.triton_rope import check_rope_args

TOKEN_GRID_LIMIT = runtime.pick(gpu=8192, cpu=256)


@triton.jit
def _rope(x_ptr, y_ptr, pos_ptr, freq_ptr, sxt, sxh, syt, syh, heads, half, BLOCK_H: tl.constexpr,
          BLOCK_D: tl.constexpr, MISTAKE: tl.constexpr):
    token = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + token + 0 * j)
    if MISTAKE == "positions_off_by_one":
        pos = pos + 1  # "position 1 is the first token"
    theta = pos.to(tl.float32) * tl.load(freq_ptr + j, mask=j < half, other=0.0)
    cos, sin = tl.cos(theta)[None, :], tl.sin(theta)[None, :]
    mask = (h[:, None] < heads) & (j[None, :] < half)
    src = x_ptr + token.to(tl.int64) * sxt + h[:, None].to(tl.int64) * sxh
    dst = y_ptr + token.to(tl.int64) * syt + h[:, None].to(tl.int64) * syh
    if MISTAKE == "interleaved_pairs":
        first, second = 2 * j[None, :], 2 * j[None, :] + 1  # the RoPE paper's (2j, 2j + 1)
    else:
        first, second = j[None, :], j[None, :] + half  # Llama's (j, j + D/2)
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)


def rope_submission(mistake: str):
    def rope(x, positions, inv_freq, out=None):
        check_rope_args("rope", x, positions, inv_freq)
        out = torch.empty_like(x) if out is None else out
        if x.numel():
            tokens, heads, head_dim = x.shape
            block_h = min(8, triton.next_power_of_2(heads))
            programs = tokens
            if mistake == "tokens_past_a_grid_limit":
                programs = min(tokens, TOKEN_GRID_LIMIT)
            _rope[(programs, triton.cdiv(heads, block_h))](
                x, out, positions, inv_freq, x.stride(0), x.stride(1), out.stride(0),
                out.stride(1), heads, head_dim // 2, BLOCK_H=block_h,
                BLOCK_D=triton.next_power_of_2(head_dim // 2), MISTAKE=mistake,
                num_warps=runtime.pick(gpu=4, cpu=1))
        return out
    return rope


@triton.jit
def _argmax_chunks(x_ptr, values_ptr, indices_ptr, width, stride_x, n_chunks, CHUNK: tl.constexpr,
                   LAST: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + col, mask=col < width, other=float("-inf")).to(tl.float32)
    if LAST:  # the last index among equals
        best = tl.max(tl.where(x == tl.max(x, 0), tl.arange(0, CHUNK), -1), 0)
    else:  # the first, as torch.argmax
        best = tl.min(tl.where(x == tl.max(x, 0), tl.arange(0, CHUNK), CHUNK), 0)
    tl.store(values_ptr + row * n_chunks + chunk, tl.max(x, 0))
    tl.store(indices_ptr + row * n_chunks + chunk, chunk * CHUNK + best)


@triton.jit
def _argmax_final(values_ptr, indices_ptr, out_ptr, n_chunks, BLOCK_CHUNKS: tl.constexpr,
                  LAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_CHUNKS)
    v = tl.load(values_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    if LAST:
        best = tl.max(tl.where(v == tl.max(v, 0), c, -1), 0)  # the last best chunk
    else:
        best = tl.min(tl.where(v == tl.max(v, 0), c, BLOCK_CHUNKS), 0)
    tl.store(out_ptr + row, tl.load(indices_ptr + row * n_chunks + best).to(tl.int64))


def argmax_submission(last_among_equals: bool, width_cap: int | None = None):
    """Every row's maximum by chunks; ties to the highest index if `last_among_equals` (numpy's
    argmax on a reversed row); with `width_cap`, only that many columns are looked at."""

    def argmax(logits, out=None):
        if logits.stride(-1) != 1:
            raise ValueError("argmax: logits must be contiguous along the vocabulary")
        rows, width = logits.shape
        width = width if width_cap is None else min(width, width_cap)
        out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
        chunk = min(runtime.pick(gpu=4096, cpu=8192), triton.next_power_of_2(width))
        n_chunks = triton.cdiv(width, chunk)
        values = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
        indices = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
        _argmax_chunks[(n_chunks, rows)](logits, values, indices, width, logits.stride(0),
                                         n_chunks, CHUNK=chunk, LAST=last_among_equals)
        _argmax_final[(rows,)](values, indices, out, n_chunks,
                               BLOCK_CHUNKS=triton.next_power_of_2(n_chunks),
                               LAST=last_among_equals)
        return out

    return argmax


# mistake -> (graded function, submission, what the grader's message must contain)
CORPUS = {
    "interleaved_pairs": ("rope", rope_submission("interleaved_pairs"),
                          "rotates the interleaved pairs (2j, 2j + 1)"),
    "positions_off_by_one": ("rope", rope_submission("positions_off_by_one"),
                             "the rotation at positions+1: positions are off by one"),
    "ties_to_the_last_index": ("argmax", argmax_submission(last_among_equals=True),
                               "ties must go to the lowest index, as torch.argmax"),
}
# Right on every fixed case: only the classes drawn per run (lab07.draw_*_cases) reach them.
# mistake -> (graded function, submission, what the grader's message must contain)
DRAWN_CORPUS = {
    # a grid of at most 256 tokens (8192 on a GPU): more than any fixed case has
    "tokens_past_a_grid_limit": ("rope", rope_submission("tokens_past_a_grid_limit"),
                                 "elements wrong"),
    # 2**17 columns looked at: Llama 3's 128256 fits; a larger vocabulary does not
    "columns_past_2**17_ignored": (
        "argmax", argmax_submission(last_among_equals=False, width_cap=2**17), "elements wrong"),
}
