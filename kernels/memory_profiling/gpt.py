"""A GPT-2-style decoder, small and explicit, so that every tensor autograd saves can be named.

Pre-norm blocks (LayerNorm -> causal self-attention through `F.scaled_dot_product_attention` ->
residual add; LayerNorm -> Linear 4x -> GELU(tanh) -> Linear -> residual add), learned positions, a
final LayerNorm and an unembedding tied to the token embedding, as GPT-2. No dropout: dropout would
save a mask per layer and make memory depend on the training mode. `estimator.py` counts this
model's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    max_seq: int = 1024
    d_model: int = 768
    layers: int = 12
    heads: int = 12

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


GPT2_SMALL = GPTConfig()
GPT2_XL = GPTConfig(d_model=1600, layers=48, heads=25)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        # q, k, v are views of the one qkv tensor: saving them for backward keeps that tensor alive
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        # (b, heads, t, hd) -> (b, t, c): a view when the kernel returned y in (b, t, heads, hd)
        # memory order (flash attention does), a copy otherwise
        return self.attn_out(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss; the logits are not returned, so they are freed at once."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        # the unembedding is the token embedding (tied)
        logits = F.linear(self.ln_f(x), self.tok.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_batch(
    cfg: GPTConfig, batch: int, seq: int, device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, seq + 1), device=device, generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def record_training_step(
    cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype, device, recorder
) -> None:
    """Build the model and AdamW, take one training step (AdamW allocates its state in the first),
    then take a second with its forward, backward and optimizer phases recorded by `recorder` (a
    `profiling.PhaseRecorder`). Everything is freed on return; the recorder keeps the
    measurements."""
    model = GPT(cfg).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx, targets = make_batch(cfg, batch, seq, device)
    model(idx, targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with recorder.phase("forward"):
        loss = model(idx, targets)
    with recorder.phase("backward"):
        loss.backward()
    with recorder.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
