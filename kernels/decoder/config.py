"""The decoder's shapes and the choices its kernels share: the config of a Llama-style model,
Llama-3.2-1B's and the CPU tests' tiny one, the projections of a layer, and the decode batches the
GEMV benchmarks time. model.py, the GEMVs and the benchmarks import this file; it imports none of
them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The GEMMs of a step, by the names Decoder.choose_decode_linears uses.
PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
# The projections that follow an RMSNorm, which triton_fused_gemv.py can fold into their GEMV
# (gate_up with SwiGLU after it too), by the names Decoder.choose_decode_fused uses.
NORMED_PROJECTIONS = ("qkv", "gate_up", "lm_head")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = True

    @property
    def qkv_width(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def n_parameters(self) -> int:
        per_layer = (
            self.hidden_size * self.qkv_width
            + self.n_heads * self.head_dim * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        embed = self.vocab_size * self.hidden_size
        return (
            self.n_layers * per_layer + self.hidden_size + embed * (1 if self.tie_embeddings else 2)
        )

    @classmethod
    def from_hf(cls, hf_config) -> "DecoderConfig":
        head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        rope = getattr(hf_config, "rope_parameters", None) or {}
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=hf_config.num_attention_heads,
            n_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_eps=hf_config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", 10000.0),
            tie_embeddings=bool(hf_config.tie_word_embeddings),
        )

    def hf_config(self, **extra):
        """The transformers LlamaConfig of this shape (for tests and benchmarks)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_embeddings,
            attention_bias=False,
            mlp_bias=False,
            hidden_act="silu",
            **extra,
        )


# Llama-3.2-1B's shapes (1.236 B parameters; its RoPE frequency scaling aside).
LLAMA_1B = DecoderConfig(
    vocab_size=128256,
    hidden_size=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
)
# The CPU tests' model: every size odd or off a power of two where the kernels allow it.
TINY = DecoderConfig(
    vocab_size=251,
    hidden_size=96,
    n_layers=3,
    n_heads=6,
    n_kv_heads=2,
    head_dim=16,
    intermediate_size=200,
    rope_theta=10000.0,
)


# The decode batches the GEMV benchmarks time (benchmark_gemv.py, benchmark_fused_gemv.py).
BATCHES = (1, 8, 32)


def projection_shapes(config) -> dict[str, tuple[int, int, int]]:
    """(N, K, launches per decode step) of each projection of a decoder config: one per layer, and
    one lm_head (the tied embedding)."""
    c = config
    return {
        "qkv": (c.qkv_width, c.hidden_size, c.n_layers),
        "o": (c.hidden_size, c.n_heads * c.head_dim, c.n_layers),
        "gate_up": (2 * c.intermediate_size, c.hidden_size, c.n_layers),
        "down": (c.hidden_size, c.intermediate_size, c.n_layers),
        "lm_head": (c.vocab_size, c.hidden_size, 1),
    }
