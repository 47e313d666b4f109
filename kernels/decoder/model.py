"""A Llama-style decoder on the course's kernels: weights from a Hugging Face state dict, a
preallocated KV cache, prefill, an eager decode step and the same step captured in a CUDA graph.

One layer, for tokens x (the residual stream r):

    y, r = fused_add_rms_norm(previous layer's output, r)      module 02 (the first layer: rms_norm)
    qkv  = y @ W_qkv^T                                         cuBLAS (q, k and v stacked: one GEMM)
                                                               or, decoding, triton_gemv.py (below)
    rope_append(qkv, positions) -> q rotated, k and v in the cache       triton_rope.py
    a    = attention(q, cache, positions)                      module 03 FlashAttention-2 (prefill),
                                                               flash-decoding (eager decode), or
                                                               triton_attention.py (graph, fp32)
    o    = a @ W_o^T                                           cuBLAS
    y, r = fused_add_rms_norm(o, r)                            module 02
    m    = swiglu(y @ W_gate_up^T) @ W_down^T                  cuBLAS, triton_ops.swiglu, cuBLAS

then the final norm, the logits (the tied embedding as lm_head) and greedy argmax (triton_ops.py).

The projections of a pass of one token per sequence (a decode step) run through cuBLAS unless
`Decoder.choose_decode_linears(batch)` measured the course's GEMV (triton_gemv.py) faster for that
projection on this GPU, in the same run; a prefill of several tokens always uses cuBLAS. Likewise
`Decoder.choose_decode_fused(batch)` may fold the norm before qkv, gate_up and lm_head into their
GEMV, and SwiGLU into gate_up's (triton_fused_gemv.py), up to three launches a layer fewer: it
captures the whole step with each subset fused and keeps the fastest (off until measured, or set by
hand with `set_decode_fused`).

`generate(..., persistent=True)` runs the decode steps as one persistent kernel each instead
(triton_persistent_step.py: no kernel boundaries inside the step); the graph stays the default
(the persistent step is slower on the H200: PERFORMANCE.md, section 6). Where the GPU has it
(Hopper and newer) the graph launches its Triton kernels with programmatic dependent launch
(pdl.py; `Decoder(..., pdl=False)` turns it off): 0.947 -> 0.903 ms a step at batch 1, context
512, on an H200, the same logits (PERFORMANCE.md, section 5.1).

Loading real weights: build the Hugging Face model from its folder and hand it over,

    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = Decoder(DecoderWeights.from_hf(hf, device="cuda"), max_batch=1, max_seq=4096)

or, without instantiating the Hugging Face model, `DecoderWeights.from_state_dict(config,
state_dict, inv_freq)` with the tensors of its safetensors files and `rope_frequencies(hf_config)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import bench, runtime
from kernels.decoder import pdl as dependent_launch
from kernels.decoder import (
    triton_attention,
    triton_fused_gemv,
    triton_gemv,
    triton_ops,
    triton_persistent_step,
    triton_rope,
)
from kernels.decoder.config import (
    MODEL_DTYPES,
    NORMED_PROJECTIONS,
    PROJECTIONS,
    DecoderConfig,
)
from kernels.flash_attention import triton_decode, triton_flash
from kernels.rmsnorm import triton_rmsnorm


def rope_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 (head_dim / 2,), attention_scaling) as transformers computes them for this
    config, including its frequency scaling (Llama 3's 'llama3' rope type)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)
    return rotary.inv_freq.float().cpu(), float(rotary.attention_scaling)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (qkv_width, hidden): q, k, v projections stacked
    o: torch.Tensor  # (hidden, n_heads * head_dim)
    mlp_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate then up
    down: torch.Tensor  # (hidden, intermediate)


@dataclass
class DecoderWeights:
    config: DecoderConfig
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden): the embedding itself when tied
    inv_freq: torch.Tensor  # float32 (head_dim / 2,)
    rope_scale: float = 1.0
    # LayerWeights' names -> the layers' tensors stacked (layers, ...): the persistent step reads
    # each with one pointer (triton_persistent_step.stacked_weights makes them on first use)
    stacks: dict | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_state_dict(
        cls,
        config: DecoderConfig,
        state_dict: dict,
        inv_freq: torch.Tensor,
        rope_scale: float = 1.0,
        *,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> "DecoderWeights":
        """From a LlamaForCausalLM state dict (keys `model.layers.{i}.self_attn.q_proj.weight`,
        ...).

        Every tensor must have the config's shape and one floating dtype: a checkpoint of another
        shape or a mixed dtype is refused with the offending key, never silently cast or truncated.
        `dtype` converts the whole model on purpose (bf16 weights to fp32 for a check)."""
        device = torch.device(device or runtime.DEVICE)
        dtypes = {t.dtype for t in state_dict.values() if isinstance(t, torch.Tensor)}
        if len(dtypes) != 1 or next(iter(dtypes)) not in MODEL_DTYPES:
            raise TypeError(
                f"DecoderWeights: the state dict's tensors must share one dtype of float32, "
                f"float16, bfloat16; found {sorted(map(str, dtypes))}"
            )
        dtype = dtype or next(iter(dtypes))
        c = config

        def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
            if key not in state_dict:
                raise KeyError(f"DecoderWeights: the state dict has no {key!r}")
            t = state_dict[key]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"DecoderWeights: {key} has shape {tuple(t.shape)}, the config needs {shape}"
                )
            return t.to(device=device, dtype=dtype)

        q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        layers = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
                    qkv=torch.cat(
                        [
                            take(p + "self_attn.q_proj.weight", (q_width, c.hidden_size)),
                            take(p + "self_attn.k_proj.weight", (kv_width, c.hidden_size)),
                            take(p + "self_attn.v_proj.weight", (kv_width, c.hidden_size)),
                        ]
                    ),
                    o=take(p + "self_attn.o_proj.weight", (c.hidden_size, q_width)),
                    mlp_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                    gate_up=torch.cat(
                        [
                            take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                            take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
                        ]
                    ),
                    down=take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
                )
            )
        embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)).contiguous()
        if c.tie_embeddings:
            lm_head = embed
        else:
            lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
        if tuple(inv_freq.shape) != (c.head_dim // 2,):
            raise ValueError(
                f"DecoderWeights: inv_freq has shape {tuple(inv_freq.shape)}, the config "
                f"needs ({c.head_dim // 2},)"
            )
        return cls(
            c,
            embed,
            layers,
            take("model.norm.weight", (c.hidden_size,)),
            lm_head,
            inv_freq.to(device=device, dtype=torch.float32).contiguous(),
            float(rope_scale),
        )

    @classmethod
    def from_hf(
        cls, hf_model, *, dtype: torch.dtype | None = None, device=None
    ) -> "DecoderWeights":
        """From a transformers LlamaForCausalLM (or a model with the same state-dict keys)."""
        config = DecoderConfig.from_hf(hf_model.config)
        inv_freq, scale = rope_frequencies(hf_model.config)
        return cls.from_state_dict(
            config, dict(hf_model.state_dict()), inv_freq, scale, dtype=dtype, device=device
        )


class KVCache:
    """K and V of every layer, preallocated: (layers, batch, KV heads, capacity, head_dim) each."""

    def __init__(self, config: DecoderConfig, batch: int, capacity: int, dtype, device):
        shape = (config.n_layers, batch, config.n_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.capacity = batch, capacity
        self.length = 0  # keys written per sequence (every sequence of the batch advances together)

    def nbytes(self, length: int | None = None) -> int:
        """Bytes of K and V up to `length` positions (the whole cache by default)."""
        n = self.capacity if length is None else length
        return 2 * self.k[:, :, :, :n].numel() * self.k.element_size()


def _check_pdl(op: str, pdl) -> None:
    """`pdl` is True, False, or None (the GPU decides: pdl.available())."""
    if pdl is not None and not isinstance(pdl, bool):
        raise ValueError(f"{op}: pdl must be True, False or None, got {pdl!r}")


class Decoder:
    """The model with its cache for up to `max_batch` sequences of `max_seq` tokens.

    `prefill(tokens)` fills the cache from position 0 and returns the last position's logits;
    `decode_step(tokens)` feeds one token per sequence; `generate(prompt, n)` is greedy decoding,
    with the decode step replayed from a CUDA graph on a GPU (`graph=True`). That graph launches
    the course's Triton kernels with programmatic dependent launch (pdl.py: each may start while
    the one before it ends; the same tokens) where the GPU has it (Hopper and newer: `pdl=None`,
    the default, asks `pdl.available()`); `pdl=False` captures the plain launches everywhere."""

    def __init__(
        self, weights: DecoderWeights, max_batch: int, max_seq: int, *, pdl: bool | None = None
    ):
        _check_pdl("Decoder", pdl)
        self.w, self.c = weights, weights.config
        self.pdl = dependent_launch.available() if pdl is None else pdl
        self.dtype, self.device = weights.dtype, weights.device
        self.max_batch, self.max_seq = max_batch, max_seq
        self.cache = KVCache(self.c, max_batch, max_seq, self.dtype, self.device)
        self.scale = 1.0 / math.sqrt(self.c.head_dim)
        # The kernels' flags for input they refused (a bad position, a bad token id), read by
        # check_status() when the host may synchronize
        self.status = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._workspaces: dict = {}
        self._graph = None
        self._persistent: dict[int, triton_persistent_step.PersistentStep] = {}
        # batch -> the projections whose decode step runs triton_gemv.linear instead of cuBLAS
        self.decode_gemv: dict[int, frozenset[str]] = {}
        # batch -> the projections whose decode step runs triton_fused_gemv with its norm (and
        # SwiGLU) folded in, whatever decode_gemv says for them
        self.decode_fused: dict[int, frozenset[str]] = {}

    # ----------------------------------------------------------------------------------------------
    # The projections: cuBLAS, or at decode time the course's GEMV where it was measured faster

    def _weight(self, projection: str) -> torch.Tensor:
        """The first layer's weight of a projection (every layer's has its shape)."""
        return self.w.lm_head if projection == "lm_head" else getattr(self.w.layers[0], projection)

    def _gemv_choice(self, batch: int, names, allowed: tuple[str, ...]) -> frozenset[str]:
        """`names` as a frozenset, after checking the GEMV can take them at this batch."""
        names = frozenset(names)
        if not names <= set(allowed):
            raise ValueError(
                f"Decoder: unknown projections {sorted(names - set(allowed))}; "
                f"the projections are {allowed}"
            )
        if names and self.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"Decoder: the GEMV takes bf16 or fp16 weights, this model is "
                f"{self.dtype}: keep cuBLAS"
            )
        if names and not 0 < batch <= triton_gemv.MAX_ROWS:
            raise ValueError(
                f"Decoder: the GEMV takes 1 to {triton_gemv.MAX_ROWS} rows, not batch {batch}"
            )
        if self._graph is not None and self._graph.batch == batch:
            self._graph = None  # captured with the old choice: generate() captures again
        return names

    def set_decode_linears(self, batch: int, gemv=()) -> None:
        """Decode steps of `batch` sequences run the projections named in `gemv` through
        triton_gemv.linear and the others through cuBLAS (F.linear)."""
        self.decode_gemv[batch] = self._gemv_choice(batch, gemv, PROJECTIONS)

    def set_decode_fused(self, batch: int, fused=()) -> None:
        """Decode steps of `batch` sequences run the projections named in `fused` (of
        NORMED_PROJECTIONS) as one triton_fused_gemv launch with the RMSNorm before them, and
        gate_up with SwiGLU after it; the others as the norm, then the linear decode_gemv chose."""
        self.decode_fused[batch] = self._gemv_choice(batch, fused, NORMED_PROJECTIONS)

    def choose_decode_linears(self, batch: int) -> dict[str, dict]:
        """Time cuBLAS and the GEMV on each projection's weight at `batch` rows on this GPU
        (kernels.bench: interleaved, L2 flushed) and keep the GEMV only where it was faster in this
        run. Returns {projection: {"cublas_us", "gemv_us", "speedup", "gemv"}}."""
        if not runtime.ON_GPU:
            raise RuntimeError(
                "Decoder.choose_decode_linears: timing needs a GPU (the CPU keeps "
                "cuBLAS unless set_decode_linears says otherwise)"
            )
        if self.dtype not in (torch.float16, torch.bfloat16) or batch > triton_gemv.MAX_ROWS:
            self.set_decode_linears(batch, ())
            return {}
        measured = {}
        for name in PROJECTIONS:
            w = self._weight(name)
            x = torch.randn(batch, w.shape[1], device=self.device).to(self.dtype)
            t = bench.benchmark(
                {"cublas": lambda: F.linear(x, w), "gemv": lambda: triton_gemv.linear(x, w)}
            )
            speedup = bench.ratio(t["cublas"], t["gemv"])
            measured[name] = {
                "cublas_us": t["cublas"].median_us,
                "gemv_us": t["gemv"].median_us,
                "speedup": speedup,
                "gemv": speedup > 1.0,
            }
        self.set_decode_linears(batch, [n for n, m in measured.items() if m["gemv"]])
        return measured

    def choose_decode_fused(self, batch: int, context: int = 512) -> dict[str, float]:
        """Capture the decode step of `batch` sequences once for every subset of
        NORMED_PROJECTIONS folded into triton_fused_gemv (the linears as choose_decode_linears
        left them), replay the graphs interleaved at cache length `context` (device events), and
        keep the fastest step. The step is timed whole, not each projection alone: on an H200 the
        fused launch alone measured 0.84x to 1.20x of the unfused pair for the same projection,
        from one process to the next, and fusing all three made the step slower
        (kernels/decoder/PERFORMANCE.md). Timing writes the cache (each capture's warm-up
        at positions 0 and 1, the replays at `context`), so it is refused after a prefill.
        Returns {"+".join(projections) or "none": step us} for the eight subsets."""
        if not runtime.ON_GPU:
            raise RuntimeError(
                "Decoder.choose_decode_fused: timing needs a GPU (the CPU keeps the norms "
                "apart unless set_decode_fused says otherwise)"
            )
        if self.cache.length:
            raise RuntimeError(
                f"Decoder.choose_decode_fused: the cache holds {self.cache.length} tokens, and "
                "timing the step would overwrite them: choose before the prefill"
            )
        if self.dtype not in (torch.float16, torch.bfloat16) or batch > triton_gemv.MAX_ROWS:
            self.set_decode_fused(batch, ())
            return {}
        context = min(context, self.max_seq - 1)
        subsets = [
            tuple(p for i, p in enumerate(NORMED_PROJECTIONS) if mask >> i & 1)
            for mask in range(2 ** len(NORMED_PROJECTIONS))
        ]
        tokens = torch.randint(0, self.c.vocab_size, (batch,), device=self.device)
        graphs = {}
        for subset in subsets:
            self.set_decode_fused(batch, subset)
            graphs["+".join(subset) or "none"] = DecodeGraph(self, batch)

        def restart():
            for step in graphs.values():
                step.start(tokens, context)

        times = bench.benchmark(
            {name: step.replay for name, step in graphs.items()},
            reps=20,
            flush=False,  # a step reads 2.5 GB: it flushes L2 itself
            before_round=restart,
        )
        measured = {name: t.median_us for name, t in times.items()}
        best = min(measured, key=measured.get)
        self.set_decode_fused(batch, () if best == "none" else best.split("+"))
        return measured

    def _linear(
        self,
        projection: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        gemv: frozenset,
        pdl: bool = False,
    ):
        if projection in gemv:
            return triton_gemv.linear(x, weight, pdl=pdl)
        return F.linear(x, weight)

    def _normed_linear(
        self,
        projection: str,
        delta: torch.Tensor | None,
        x: torch.Tensor,
        norm: torch.Tensor,
        weight: torch.Tensor,
        choice: tuple[frozenset, frozenset],
        *,
        swiglu: bool = False,
        sequence_length: int = 1,
        pdl: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(delta + x) * norm @ weight.T, then SwiGLU if asked; delta + x): the residual
        add (none where delta is None), the norm and the projection, as one triton_fused_gemv launch
        if `projection` is in the fused half of `choice` (fused, gemv), else module 02's norm and
        _linear. The fused kernel writes the new residual into a new buffer, never over x: its other
        programs are still reading x. `sequence_length` > 1 (lm_head in a prefill): only the last
        row of each sequence is projected."""
        fused, gemv = choice
        eps = self.c.rms_eps
        if projection in fused:
            return triton_fused_gemv.add_rms_norm_linear(
                delta, x, norm, weight, eps, swiglu=swiglu, pdl=pdl
            )
        if delta is None:
            y = triton_rmsnorm.rms_norm(x, norm, eps)
        else:
            y, x = triton_rmsnorm.fused_add_rms_norm(delta, x, norm, eps)
        if sequence_length > 1:
            y = y.view(-1, sequence_length, y.shape[-1])[:, -1]
        out = self._linear(projection, y, weight, gemv, pdl)
        return (triton_ops.swiglu(out) if swiglu else out), x

    # ----------------------------------------------------------------------------------------------
    # One forward pass over new tokens

    def attention_workspace(self, batch: int, n_q: int) -> triton_attention.AttentionWorkspace:
        key = (batch, n_q)
        if key not in self._workspaces:
            self._workspaces[key] = triton_attention.AttentionWorkspace(
                batch, self.c.n_heads, n_q, self.max_seq, self.c.head_dim, self.device
            )
        return self._workspaces[key]

    def _attention(self, layer: int, q, positions, n_keys: int | None, out, pdl: bool = False):
        """out (B, Hq, T, D) for q (B, Hq, T, D). `n_keys` is the cache length after this step when
        the host knows it (eager), None inside a graph: then the positions on the device decide."""
        batch, _, n_q, _ = q.shape
        k_cache, v_cache = self.cache.k[layer, :batch], self.cache.v[layer, :batch]
        half = self.dtype != torch.float32  # modules 03's kernels take fp16/bf16
        if half and n_keys is not None and n_q > 1:
            triton_flash.flash_attention_forward(
                q,
                k_cache[:, :, :n_keys],
                v_cache[:, :, :n_keys],
                causal=True,
                scale=self.scale,
                out=out,
            )
        elif half and n_keys is not None:
            triton_decode.flash_decode(
                q, k_cache[:, :, :n_keys], v_cache[:, :, :n_keys], scale=self.scale, out=out
            )
        else:
            workspace = self.attention_workspace(batch, n_q)
            triton_attention.cache_attention(
                q, k_cache, v_cache, positions, out, workspace, self.scale, pdl=pdl
            )
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        n_keys: int | None = None,
        hidden_states: list | None = None,
        *,
        pdl: bool = False,
    ) -> torch.Tensor:
        """Logits (B, vocab) of the last of T new tokens per sequence; tokens (B, T), positions
        (B T,) on the device. Appends each layer's output (B, T, hidden) to `hidden_states` if
        given. `pdl`: the course's Triton kernels launched with programmatic dependent launch
        where the GPU has it (pdl.py; the same results)."""
        c, w = self.c, self.w
        batch, n_q = tokens.shape
        rows = batch * n_q
        # (rows, hidden): the residual stream
        x = triton_ops.embedding(tokens.reshape(-1), w.embed, status=self.status)
        delta = None  # the last sublayer's output, not yet added to x: the next norm adds it
        attn = torch.empty(
            (batch, n_q, c.n_heads, c.head_dim), dtype=self.dtype, device=self.device
        )
        decode = n_q == 1
        gemv = self.decode_gemv.get(batch, frozenset()) if decode else frozenset()
        fused = self.decode_fused.get(batch, frozenset()) if decode else frozenset()
        choice = (fused, gemv)
        for i, layer in enumerate(w.layers):
            # (rows, (Hq + 2 Hkv) D); x becomes the previous layer's output
            qkv, x = self._normed_linear(
                "qkv", delta, x, layer.attn_norm, layer.qkv, choice, pdl=pdl
            )
            if delta is not None and hidden_states is not None:
                hidden_states.append(x.view(batch, n_q, -1).clone())
            triton_rope.rope_append(
                qkv,
                positions,
                w.inv_freq,
                self.cache.k[i, :batch],
                self.cache.v[i, :batch],
                self.status,
                n_q_heads=c.n_heads,
                n_kv_heads=c.n_kv_heads,
                batch=batch,
                scale=w.rope_scale,
                pdl=pdl,
            )
            q = qkv.view(batch, n_q, -1, c.head_dim)[:, :, : c.n_heads].transpose(1, 2)
            self._attention(i, q, positions, n_keys, attn.transpose(1, 2), pdl)
            o = self._linear("o", attn.view(rows, -1), layer.o, gemv, pdl)
            h, x = self._normed_linear(
                "gate_up", o, x, layer.mlp_norm, layer.gate_up, choice, swiglu=True, pdl=pdl
            )
            delta = self._linear("down", h, layer.down, gemv, pdl)
        logits, x = self._normed_linear(
            "lm_head", delta, x, w.norm, w.lm_head, choice, sequence_length=n_q, pdl=pdl
        )
        if hidden_states is not None:  # the last layer's output
            hidden_states.append(x.view(batch, n_q, -1).clone())
        return logits

    # ----------------------------------------------------------------------------------------------
    # Prefill and eager decode: the host knows the length and checks it before anything is written

    def _check_tokens(self, tokens: torch.Tensor, new: int, cached: int | None = None) -> None:
        """Refuse before anything is launched: `new` tokens after `cached` ones (the cache's length
        by default) must fit the cache."""
        cached = self.cache.length if cached is None else cached
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in triton_ops.TOKEN_DTYPES:
            raise TypeError(
                f"Decoder: tokens must be an int32/int64 tensor, got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)}"
            )
        if tokens.dim() != 2 or not 0 < tokens.shape[0] <= self.max_batch:
            raise ValueError(
                f"Decoder: tokens must be (batch, seq) with 1 <= batch <= {self.max_batch}, "
                f"got {tuple(tokens.shape)}"
            )
        if cached + new > self.max_seq:
            raise ValueError(
                f"Decoder: {cached} cached + {new} new tokens exceed the cache's "
                f"{self.max_seq} positions; make the Decoder with a larger max_seq"
            )

    def reset(self) -> None:
        self.cache.length = 0
        self.status.zero_()

    def prefill(self, tokens: torch.Tensor, hidden_states: list | None = None) -> torch.Tensor:
        """Run the prompts tokens (B, T) from position 0; returns the logits of their last token.

        Token ids on the CPU are checked here. Ids already on the device are not: reading them
        back would stall the host until the GPU is idle, so the embedding kernel flags a bad id
        instead (a row of zeros goes in its place) and check_status() raises."""
        self._check_tokens(tokens, tokens.shape[-1] if tokens.dim() == 2 else 0, cached=0)
        if tokens.device.type == "cpu" and bool(
            ((tokens < 0) | (tokens >= self.c.vocab_size)).any()
        ):
            raise ValueError(f"Decoder: token ids must lie in [0, {self.c.vocab_size})")
        self.reset()
        batch, n = tokens.shape
        positions = torch.arange(n, dtype=torch.int32, device=self.device).repeat(batch)
        logits = self.forward(tokens.to(self.device).contiguous(), positions, n, hidden_states)
        self.cache.length = n
        return logits

    def decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One new token per sequence (tokens (B,), any strides) at the cache's length; returns
        logits (B, vocab). `positions` (B,) int32 on the device may be passed to skip making it (it
        must hold the length)."""
        tokens = tokens.reshape(-1, 1)
        self._check_tokens(tokens, 1)
        if positions is None:
            positions = torch.full(
                (tokens.shape[0],), self.cache.length, dtype=torch.int32, device=self.device
            )
        logits = self.forward(tokens.contiguous(), positions, self.cache.length + 1)
        self.cache.length += 1
        return logits

    def check_status(self) -> None:
        """Raise if a kernel refused input since the last reset(): a position outside the KV cache
        (nothing was written there) or a token id outside the vocabulary (read as zeros). Reads
        the flags, so it synchronizes."""
        flags = int(self.status.item())
        if flags & triton_rope.STATUS_POSITION_OUT_OF_RANGE:
            raise RuntimeError(
                "Decoder: a position outside the KV cache was refused (nothing was written "
                "there); reset() the decoder or make it with a larger max_seq"
            )
        if flags & triton_ops.STATUS_TOKEN_OUT_OF_RANGE:
            raise RuntimeError(
                f"Decoder: a token id outside [0, {self.c.vocab_size}) was read as a row of "
                "zeros, so the logits since the last reset() are wrong; check the tokenizer "
                "matches this model"
            )

    # ----------------------------------------------------------------------------------------------
    # The decode step in a CUDA graph: tokens and positions live in device buffers the graph reads

    def capture_decode_graph(self, batch: int, *, pdl: bool | None = None) -> "DecodeGraph":
        """The decode step of `batch` captured (the graph generate() replays); `pdl` overrides
        the decoder's own choice for this graph."""
        if not runtime.ON_GPU:
            raise RuntimeError("Decoder.capture_decode_graph: CUDA graphs need a GPU")
        self._graph = DecodeGraph(self, batch, pdl=pdl)
        return self._graph

    def persistent_step(self, batch: int, **options) -> "triton_persistent_step.PersistentStep":
        """The decode step of `batch` as one persistent launch (triton_persistent_step.py), made
        once per batch (again if `options` are given)."""
        step = self._persistent.get(batch)
        if step is None or options:
            step = triton_persistent_step.PersistentStep(self, batch, **options)
            self._persistent[batch] = step
        return step

    def generate(
        self,
        prompt: torch.Tensor,
        new_tokens: int,
        *,
        graph: bool = True,
        persistent: bool = False,
    ) -> torch.Tensor:
        """Greedy decoding: (B, T + new_tokens) token ids, the prompt first. `persistent` runs
        the decode steps as the persistent kernel instead of the CUDA graph (or eager steps)."""
        self._check_tokens(prompt, 0, cached=0)
        if prompt.shape[1] + new_tokens > self.max_seq:
            raise ValueError(
                f"Decoder: a {prompt.shape[1]}-token prompt + {new_tokens} new tokens exceed "
                f"the cache's {self.max_seq} positions"
            )
        batch = prompt.shape[0]
        out = torch.empty(
            (batch, prompt.shape[1] + new_tokens), dtype=torch.int64, device=self.device
        )
        out[:, : prompt.shape[1]] = prompt
        if new_tokens == 0:
            return out
        use_graph = graph and runtime.ON_GPU and not persistent
        if use_graph and (self._graph is None or self._graph.batch != batch):
            self.capture_decode_graph(batch)  # before the prefill: its warm-up writes the cache
        token = triton_ops.argmax(self.prefill(prompt))
        out[:, prompt.shape[1]] = token
        if use_graph or persistent:
            step = self.persistent_step(batch) if persistent else self._graph
            step.start(token, self.cache.length)
        for t in range(prompt.shape[1] + 1, prompt.shape[1] + new_tokens):
            if use_graph or persistent:
                token = step.replay()
                self.cache.length += 1
            else:
                token = triton_ops.argmax(self.decode_step(token))
            out[:, t] = token
        self.check_status()
        if persistent:
            step.check()
        return out


class DecodeGraph:
    """The decode step captured once: replay() reads `tokens` and `positions` from device buffers,
    writes the next tokens (greedy) back into `tokens` and advances `positions`, so the same graph
    serves every step with no host-to-device copy in between. `pdl` (the model's choice by
    default): the step's Triton kernels launched with programmatic dependent launch."""

    def __init__(self, model: Decoder, batch: int, *, pdl: bool | None = None):
        _check_pdl("Decoder.capture_decode_graph", pdl)
        self.model, self.batch = model, batch
        self.pdl = model.pdl if pdl is None else pdl
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=model.device)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=model.device)
        saved = model.cache.length
        # Warm up (compiles and autotunes every kernel) at positions 0 and 1, then restore the
        # cache's length: the warm-up writes those positions of the cache, so capture before a
        # prefill.
        self.logits = None
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        # cuBLAS keeps one workspace per stream, and every capture runs on the same capture stream:
        # a workspace made in an earlier graph's memory pool would be baked into this graph, and
        # freed under it when that graph goes or when anyone clears the workspaces (torch.compile's
        # CUDA graphs do, before and after each recording): the replay then reads freed memory.
        # Cleared before the capture, the GEMMs allocate their workspace in this graph's own pool,
        # which lives as long as the graph; cleared after, no later capture inherits it. (The same
        # rule as torch._inductor.cudagraph_trees.clear_cublas_manager.)
        torch._C._cuda_clearCublasWorkspaces()
        with torch.cuda.graph(self.graph):
            self._step()
        torch._C._cuda_clearCublasWorkspaces()
        model.cache.length = saved

    def _step(self) -> None:
        self.logits = self.model.forward(
            self.tokens.view(-1, 1), self.positions, None, pdl=self.pdl
        )
        triton_ops.argmax(self.logits, out=self.tokens, pdl=self.pdl)
        self.positions.add_(1)

    def start(self, tokens: torch.Tensor, length: int) -> None:
        """Set the step's input: the last tokens (B,) and the cache length they go to."""
        self.tokens.copy_(tokens)
        self.positions.fill_(length)

    def replay(self) -> torch.Tensor:
        """One decode step; returns the `tokens` buffer (the next tokens), valid until the next
        replay."""
        self.graph.replay()
        return self.tokens
