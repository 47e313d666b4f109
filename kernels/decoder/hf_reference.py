"""The Hugging Face side: a LlamaForCausalLM of a given shape with seeded random weights, its hidden
states after every layer (forward hooks), and greedy agreement between two models with a rule for
near-ties.

No weights can be downloaded here, so the checks build the model from a config. The weights are
drawn so that activations keep a healthy scale through the layers (unit-variance embeddings, linear
layers scaled by 1/sqrt(fan_in), norms around 1): with Hugging Face's default initialization (std
0.02) the logits of a random model are nearly equal and greedy decoding would compare near-ties
only.
"""

from __future__ import annotations

import math

import torch


def random_llama(config, *, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A transformers LlamaForCausalLM of `config` (a DecoderConfig) with seeded random weights, in
    eval mode, on `device` in `dtype`."""
    from transformers import LlamaForCausalLM

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config.hf_config()).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                values = torch.rand(p.shape, generator=gen, device=device) + 0.5
            elif "embed_tokens" in name:
                values = torch.randn(p.shape, generator=gen, device=device)
            else:
                values = torch.randn(p.shape, generator=gen, device=device) / math.sqrt(p.shape[1])
            p.copy_(values)
    return model


def hidden_states_by_layer(model, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits (B, T, vocab), each decoder layer's output (B, T, hidden)) of one forward pass, taken
    by forward hooks on the layers (what each layer hands the next, before the final norm)."""
    outputs = []

    def hook(module, args, output):
        outputs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(tokens, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return logits, outputs


def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Hugging Face's greedy `generate`: (B, T + new_tokens) token ids."""
    with torch.no_grad():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )


def near_tie_agreement(logits: torch.Tensor, chosen: torch.Tensor, margin: float) -> torch.Tensor:
    """Whether each chosen token is a greedy choice of `logits` up to `margin`: its logit is within
    `margin` of the row's maximum. logits (N, vocab), chosen (N,). Where two logits are closer than
    the rounding error of the model's dtype, either model may pick either: this is the rule that
    judges a bf16 greedy sequence against another implementation's."""
    best = logits.float().max(dim=-1).values
    picked = logits.float().gather(-1, chosen.view(-1, 1)).squeeze(-1)
    return picked >= best - margin
