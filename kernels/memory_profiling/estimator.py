"""How much memory training `gpt.GPT` needs, counted tensor by tensor.

The model, for batch B, sequence T (N = B*T tokens), width C, L layers, H heads, vocabulary V, and
b bytes per element of the training dtype (parameters, activations and AdamW state all in it):

* **parameters** P = V*C + T_max*C (embeddings; the unembedding is tied) + L*(12*C^2 + 13*C) + 2*C;
  **gradients** P (allocated during backward), **AdamW state** 2P (exp_avg, exp_avg_sq, from
  step 1 on).
* **activations saved for backward, per layer** (what autograd keeps between forward and backward):

  | saved by | tensor | elements |
  |---|---|---|
  | ln1 | its input x (the residual stream) | N*C |
  | ln1 | mean and 1/std, float32 | 2N (4 bytes each) |
  | qkv Linear | its input, ln1's output | N*C |
  | attention (SDPA) | q, k, v: views of the qkv output, which stays alive | 3*N*C |
  | attention | its output y | N*C |
  | attention | log-sum-exp per row, float32 | B*H*T (4 bytes) |
  | attention output Linear | its input y as (B, T, C), copied if SDPA's layout needs | 0 or N*C |
  | ln2 | its input x + attention (a new residual tensor) | N*C |
  | ln2 | mean and 1/std | 2N (4 bytes) |
  | fc Linear | its input, ln2's output | N*C |
  | GELU | its input, fc's output | 4*N*C |
  | fc_out Linear | its input, GELU's output | 4*N*C |

  16 N*C elements per layer (17 with the copy) plus the float32 statistics. The residual add saves
  nothing; the block's output is the next block's (and ln_f's) saved input. Before the blocks:
  x0 = token + position embeddings (N*C). After: ln_f's mean/std and its output (saved by the
  unembedding).
* **the loss**: logits (N*V), then log_softmax's output (N*V, saved). Forward peaks with both alive.
  The block outputs: x0 (embeddings) and each block's output, L+1 tensors of N*C; the position ids.
  Backward begins with nll_loss's gradient (N*V, zeros but a target per row) and log_softmax's
  gradient (N*V) while log_softmax's output is still saved: 3*N*V*b at once, the peak of a step at
  GPT-2's vocab.
* **the caching allocator** rounds every block up to a multiple of 512 bytes (`rounding=512`), and
  cuBLAS takes a workspace from it (`workspace`, a few MiB to 32 MiB, once per stream) -- both only
  on a GPU. On the CPU (`rounding=1, workspace=0`) the profiler counts requested bytes.
* **the AdamW step** (PyTorch's foreach implementation) makes one temporary per parameter (sqrt of
  exp_avg_sq): P*b above parameters, gradients and state.

The peak of a full step (steady state, AdamW state allocated, gradients set to None by zero_grad) is
the largest of: the forward peak, the backward-start peak, and the optimizer step's. Measured on the
GPU it should agree within 10% (notebook 05 and `tests/test_memory_profiling.py` check it on the
GPU, and exactly on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.memory_profiling.gpt import GPTConfig

ALLOCATOR_ROUNDING = 512  # bytes: the CUDA caching allocator's block granularity (kMinBlockSize)
# bytes: cuBLAS's default workspace on Hopper (CUBLAS_WORKSPACE_CONFIG=:4096:8)
CUBLAS_WORKSPACE = 32 * 2**20


def _round(nbytes: int, rounding: int) -> int:
    return -(-nbytes // rounding) * rounding if nbytes else 0


def parameter_count(cfg: GPTConfig) -> int:
    c = cfg.d_model
    return cfg.vocab * c + cfg.max_seq * c + cfg.layers * (12 * c * c + 13 * c) + 2 * c


@dataclass
class MemoryEstimate:
    """Bytes, by what holds them, and the peak of each phase."""

    parameters: int
    gradients: int
    adam_state: int
    saved_per_layer: int
    saved_activations: int  # all layers, embeddings and ln_f: what forward leaves for backward
    logits: int  # one (N, V) tensor
    inputs: int  # idx and targets
    workspace: int
    peak_forward: int
    peak_forward_backward: int
    peak_optimizer: int
    peak_step: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def table(self, unit: str = "MiB") -> str:
        scale = {"MiB": 2**20, "GiB": 2**30}[unit]
        return "\n".join(f"{k:<24}{v / scale:>12,.1f} {unit}" for k, v in self.as_dict().items())


def estimate(
    cfg: GPTConfig,
    batch: int,
    seq: int,
    dtype: torch.dtype = torch.float32,
    *,
    rounding: int = ALLOCATOR_ROUNDING,
    workspace: int = CUBLAS_WORKSPACE,
    attention_copy: bool = False,
    adam: bool = True,
) -> MemoryEstimate:
    """Estimate `gpt.GPT(cfg)`'s memory for one training step at (batch, seq) in `dtype`.

    `attention_copy`: True if reshaping SDPA's output to (B, T, C) copies it (an SDPA kernel that
    returns (B, H, T, hd)-ordered memory); False for flash attention, whose output is (B, T, H, hd)
    in memory. `adam=False`: no optimizer state (a forward/backward without an optimizer).
    """
    if seq > cfg.max_seq:
        raise ValueError(f"estimate: seq {seq} exceeds the model's max_seq {cfg.max_seq}")
    b = torch.empty((), dtype=dtype).element_size()
    n, c, v = batch * seq, cfg.d_model, cfg.vocab

    def t(
        elements: int, size: int = b
    ) -> int:  # one tensor's bytes as the allocator hands them out
        return _round(elements * size, rounding)

    c2, c = cfg.d_model**2, cfg.d_model
    param_shapes = (
        [v * c, cfg.max_seq * c]
        + cfg.layers * [3 * c2, 3 * c, c2, c, 4 * c2, 4 * c, 4 * c2, c, c, c, c, c]
        + [c, c]
    )
    assert sum(param_shapes) == parameter_count(cfg)
    params = sum(t(e) for e in param_shapes)
    stats = 2 * t(n, 4)  # a LayerNorm's mean and 1/std
    # fc output (GELU's input), GELU output (fc_out's input)
    per_layer = (
        t(n * c)  # ln1 input: the residual stream entering the block
        + stats
        + t(n * c)  # ln1 statistics, its output (qkv's input)
        + t(3 * n * c)  # qkv output, alive through the q, k, v views SDPA saves
        + t(n * c)
        + t(batch * cfg.heads * seq, 4)  # SDPA output and log-sum-exp
        + (t(n * c) if attention_copy else 0)
        + t(n * c)
        + stats
        + t(n * c)  # ln2 input (new residual), statistics, output
        + t(4 * n * c)
        + t(4 * n * c)
    )
    # per_layer counts each block's input (x0 for block 0); the last block's output is ln_f's input;
    # the position ids (seq int64) are saved by the position embedding
    saved = cfg.layers * per_layer + t(n * c) + stats + t(n * c) + t(seq, 8)
    logits = t(n * v)
    inputs = 2 * t(n, 8)
    grads = params
    state = 2 * params if adam else 0
    static = params + state + inputs + workspace
    peak_forward = static + saved + 2 * logits  # logits and log_softmax's output, both alive
    peak_backward = static + saved + 3 * logits  # log_softmax output, nll grad, log_softmax grad
    peak_optimizer = static + grads + (params if adam else 0)  # + the foreach sqrt temporary
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        adam_state=state,
        saved_per_layer=per_layer,
        saved_activations=saved,
        logits=logits,
        inputs=inputs,
        workspace=workspace,
        peak_forward=peak_forward,
        peak_forward_backward=peak_backward,
        peak_optimizer=peak_optimizer,
        peak_step=max(peak_forward, peak_backward, peak_optimizer),
    )


def residual_stream_bytes(batch: int, seq: int, d_model: int, bytes_per_element: int = 4) -> int:
    """One residual-stream tensor (B, T, C): 4 * 256 * 1600 * 4 B for GPT-2 XL at batch 4, sequence
    256 in float32: 6.25 MiB (8 bytes an element, as in float64, would be 12.5 MB)."""
    return batch * seq * d_model * bytes_per_element
