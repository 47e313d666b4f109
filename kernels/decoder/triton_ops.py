"""The decoder's small kernels in Triton: the embedding gather, the SwiGLU activation and greedy
argmax.

Each is memory-bound and tiny at decode time (one row per sequence), so what they cost is mostly
their launch: the wrappers check their arguments with a few attribute reads and launch one kernel
(two for argmax), and a CUDA graph removes even that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder.pdl import launch_options, wait_then_release
from kernels.validate import FLOAT_DTYPES

TOKEN_DTYPES = (torch.int32, torch.int64)
BLOCK_COLUMNS = runtime.pick(gpu=1024, cpu=8192)  # elements of a row per program
# argmax splits a row of the vocabulary over programs: 128256 logits in 4096-wide chunks are 32
# programs per row (one row at batch 1 would otherwise stream 250 KB through one SM).
ARGMAX_CHUNK = runtime.pick(gpu=4096, cpu=65536)
STATUS_TOKEN_OUT_OF_RANGE = 2  # the bit embedding sets in a status word (RoPE's is 1)


def _on_device(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.DEVICE:
            raise ValueError(f"{op}: {name} is on {t.device}; this kernel runs on {runtime.DEVICE}")


# --------------------------------------------------------------------------------------------------
# Embedding: out[t] = table[ids[t]]


@triton.jit
def embedding_kernel(
    IDS, TABLE, OUT, STATUS, vocab, width, BLOCK: tl.constexpr, FLAG: tl.constexpr
):
    token = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    idx = tl.load(IDS + token + 0 * col)  # the token's id, once per column
    bad = (idx < 0) | (idx >= vocab)
    if FLAG != 0:  # one lane per token raises the flag: the host learns of it without a sync
        tl.atomic_or(STATUS + 0 * col, FLAG, mask=bad & (col == 0))
    ok = (col < width) & (bad == 0)  # an id outside the table gives a zero row
    row = tl.load(TABLE + tl.where(ok, idx, 0).to(tl.int64) * width + col, mask=ok, other=0.0)
    tl.store(OUT + token.to(tl.int64) * width + col, row, mask=col < width)


def embedding(
    ids: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
) -> torch.Tensor:
    """table[ids]: ids of any shape (int32/int64, contiguous), table (vocab, width) contiguous. An
    id outside [0, vocab) gives a row of zeros and, if `status` (an int32 flag word on the device)
    is given, ORs STATUS_TOKEN_OUT_OF_RANGE into it: checking ids on the host would synchronize."""
    _on_device("embedding", ids=ids, table=table)
    if ids.dtype not in TOKEN_DTYPES:
        raise TypeError(f"embedding: ids must be an int32/int64 tensor, got {ids.dtype}")
    if not ids.is_contiguous():
        raise ValueError(
            f"embedding: ids must be contiguous, got strides {ids.stride()}: pass ids.contiguous()"
        )
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(
            f"embedding: table must be a contiguous (vocab, width) tensor, got {tuple(table.shape)}"
        )
    vocab, width = table.shape
    if out is None:
        out = torch.empty((*ids.shape, width), dtype=table.dtype, device=table.device)
    elif out.shape != (*ids.shape, width) or out.dtype != table.dtype or not out.is_contiguous():
        raise ValueError(f"embedding: out must be contiguous {(*ids.shape, width)} {table.dtype}")
    if status is not None and (status.dtype != torch.int32 or status.device != table.device):
        raise ValueError(f"embedding: status must be an int32 tensor on {table.device}")
    if ids.numel():
        block = min(BLOCK_COLUMNS, triton.next_power_of_2(width))
        embedding_kernel[(ids.numel(), triton.cdiv(width, block))](
            ids,
            table,
            out,
            ids if status is None else status,  # (unread without a flag)
            vocab,
            width,
            BLOCK=block,
            FLAG=0 if status is None else STATUS_TOKEN_OUT_OF_RANGE,
            num_warps=runtime.pick(gpu=4, cpu=1),
        )
    return out


# --------------------------------------------------------------------------------------------------
# SwiGLU: out = silu(gate) * up, gate and up side by side in one GEMM's output row


@triton.jit
def swiglu_kernel(GATE_UP, OUT, width, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    gate = tl.load(GATE_UP + row * stride_in + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_in + width + col, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * stride_out + col, y.to(OUT.dtype.element_ty), mask=mask)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up (rows, 2 I) = [gate | up]: the output of one GEMM with the gate
    and up projections stacked, so the MLP reads x once and the activation is one pass. Returns
    (rows, I)."""
    _on_device("swiglu", gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"swiglu: gate_up must be (rows, 2 * I) with contiguous rows, got "
            f"{tuple(gate_up.shape)} strides {gate_up.stride()}"
        )
    if gate_up.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"swiglu: gate_up must be float32, float16 or bfloat16, not {gate_up.dtype}"
        )
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (rows, width) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"swiglu: out must be ({rows}, {width}) {gate_up.dtype}")
    if out.numel():
        block = min(BLOCK_COLUMNS, triton.next_power_of_2(width))
        swiglu_kernel[(rows, triton.cdiv(width, block))](
            gate_up,
            out,
            width,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=runtime.pick(gpu=4, cpu=1),
        )
    return out


# --------------------------------------------------------------------------------------------------
# Greedy sampling: the index of each row's largest logit, the first one among equals (as
# torch.argmax)


@triton.jit
def argmax_chunk_kernel(
    X, VALUES, INDICES, width, stride_x, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr = False
):
    """Program (chunk, row): the maximum of one chunk of a row, and the first index holding it."""
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + col, mask=col < width, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks at the top, as in torch.argmax
    index = tl.argmax(x, 0, tie_break_left=True)
    tl.store(VALUES + row * n_chunks + chunk, tl.max(x, 0))
    tl.store(INDICES + row * n_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def argmax_final_kernel(
    VALUES, INDICES, OUT, n_chunks, BLOCK_CHUNKS: tl.constexpr, PDL: tl.constexpr = False
):
    """One program per row: the best chunk, the first among equals (chunks are in index order)."""
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_CHUNKS)
    v = tl.load(VALUES + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    best = tl.argmax(v, 0, tie_break_left=True)
    index = tl.load(INDICES + row * n_chunks + best)
    tl.store(OUT + row, index.to(OUT.dtype.element_ty))


def argmax(
    logits: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for logits (rows, vocab): int64 (rows,), ties to the lowest
    index. NaN ranks with +inf (torch ranks it above; finite logits hold neither). Two launches: the
    maxima of chunks of each row, then one program per row picks the first best chunk. `pdl`:
    launched with programmatic dependent launch where the GPU has it (pdl.py)."""
    _on_device("argmax", logits=logits)
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(
            f"argmax: logits must be a non-empty (rows, vocab) tensor with contiguous rows, "
            f"got {tuple(logits.shape)} strides {logits.stride()}"
        )
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"argmax: logits must be float32, float16 or bfloat16, not {logits.dtype}")
    rows, width = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype not in TOKEN_DTYPES or not out.is_contiguous():
        raise ValueError(f"argmax: out must be a contiguous int64/int32 tensor of shape ({rows},)")
    if rows:
        chunk = min(ARGMAX_CHUNK, triton.next_power_of_2(width))
        n_chunks = triton.cdiv(width, chunk)
        values = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
        indices = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
        argmax_chunk_kernel[(n_chunks, rows)](
            logits,
            values,
            indices,
            width,
            logits.stride(0),
            n_chunks,
            CHUNK=chunk,
            num_warps=runtime.pick(gpu=8, cpu=1),
            **launch_options(pdl),
        )
        argmax_final_kernel[(rows,)](
            values,
            indices,
            out,
            n_chunks,
            BLOCK_CHUNKS=triton.next_power_of_2(n_chunks),
            num_warps=1,
            **launch_options(pdl),
        )
    return out
