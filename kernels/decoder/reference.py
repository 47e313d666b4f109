"""The specification: every operation of the decoder in plain PyTorch, and the whole model in
float64.

A kernel is compared with these on the same (low-precision) inputs; the model as a whole is compared
with `forward_fp64` (the same weights, every product and sum in float64) within LOGITS_TOLERANCE,
and with Hugging Face's LlamaForCausalLM (tests/test_decoder.py), which nobody here wrote.
"""

from __future__ import annotations

import math

import torch

# |logits - forward_fp64| <= tolerance * rms(forward_fp64 logits), by the model's dtype. float32
# rounds every product and sum of some hundred-term dot products (measured on the tiny test model:
# ~1e-6); bfloat16 rounds every activation to 8 bits of mantissa, layer after layer (measured:
# ~2e-2).
LOGITS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def rope_fp64(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """x (tokens, heads, D) rotated by position * inv_freq on the half-split pairs (j, j + D/2)."""
    half = x.shape[-1] // 2
    # The angle rounded to float32 as the kernels (and Hugging Face) compute it: one product.
    theta = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    cos, sin = (theta.cos() * scale)[:, None, :], (theta.sin() * scale)[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_fp64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """q (B, Hq, T, D) against k, v (B, Hkv, S, D): query (b, i) sees keys 0 ... positions[b * T +
    i]."""
    batch, n_heads, n_q, head_dim = q.shape
    group = n_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(head_dim)
    keys = torch.arange(k.shape[2], device=q.device)
    visible = keys[None, None, :] <= positions.view(batch, n_q, 1).to(q.device)  # (B, T, S)
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def swiglu_fp64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling as torch does it: the first index of each row's maximum."""
    return torch.argmax(logits, dim=-1)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def forward_fp64(weights, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits of every position (B, T, vocab), each layer's output (B, T, hidden)) in float64, for
    prompts tokens (B, T) from position 0, with `weights` a DecoderWeights."""
    c = weights.config
    d = lambda t: t.double()  # noqa: E731
    batch, n = tokens.shape
    positions = torch.arange(n, device=tokens.device).repeat(batch)
    x = d(weights.embed)[tokens]
    outputs = []
    q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for layer in weights.layers:
        y = _rms_norm(x, d(layer.attn_norm), c.rms_eps)
        qkv = y @ d(layer.qkv).T
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = rope_fp64(
            q.reshape(batch * n, c.n_heads, c.head_dim),
            positions,
            weights.inv_freq,
            weights.rope_scale,
        )
        k = rope_fp64(
            k.reshape(batch * n, c.n_kv_heads, c.head_dim),
            positions,
            weights.inv_freq,
            weights.rope_scale,
        )
        heads = lambda t, h: t.reshape(batch, n, h, c.head_dim).transpose(1, 2)  # noqa: E731
        a = attention_fp64(
            heads(q, c.n_heads), heads(k, c.n_kv_heads), heads(v, c.n_kv_heads), positions
        )
        x = x + a.transpose(1, 2).reshape(batch, n, q_width) @ d(layer.o).T
        y = _rms_norm(x, d(layer.mlp_norm), c.rms_eps)
        x = x + swiglu_fp64(y @ d(layer.gate_up).T) @ d(layer.down).T
        outputs.append(x)
    return _rms_norm(x, d(weights.norm), c.rms_eps) @ d(weights.lm_head).T, outputs


def logits_error(logits: torch.Tensor, want: torch.Tensor) -> float:
    """max |logits - want| / rms(want): the number LOGITS_TOLERANCE bounds."""
    want = want.double()
    return float((logits.double() - want).abs().max() / want.pow(2).mean().sqrt())
