"""The Llama decoder family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Phi-3/4, Gemma 2/3, and with a mixture
of experts Mixtral and Qwen3-MoE) in plain torch over a flattened token batch.

One forward covers every token scheduled in a step, from any number of sequences, laid out back to
back; attention reads and writes the paged KV cache through an AttentionBackend. Projections are
fused (q|k|v and gate|up) so each layer runs two large matmuls instead of five small ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.lora.layers import LoRAContext, LoRALinear
from engine.models.config import ModelConfig
from engine.models.moe import SparseMoeBlock
from engine.models.rope import RotaryEmbedding, uses_long_factors
from kernels import cpu_decode_layer, cpu_fused

KVCache = tuple[torch.Tensor, torch.Tensor]

# Batches up to this many rows multiply by oneDNN-packed weights on CPU (engine.models.loader).
# The batch size oneDNN is told to pack linear weights for on CPU; the packed layout serves any
# number of rows (see engine.models.loader).
PACKED_HINT_ROWS = 64


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x times a weight that oneDNN packed for narrow batches (see engine.models.loader)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """The half-split rotation x * cos + rotate_half(x) * sin (transformers' form), bit for bit, in
    four passes instead of five: rotate_half's negation moves from x's second half into the sine
    table, since (-a) * b == a * (-b) exactly. (No addcmul: it rounds once where that form rounds
    twice.)

    x: (num_tokens, num_heads, head_dim); cos, sin_signed: (num_tokens, head_dim), where sin_signed
    is sin with its first half negated.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # second half first
    return (x * cos[:, None, :]).add_(swapped.mul_(sin_signed[:, None, :]))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        """`unit_offset` (Gemma): the weight is an offset from one, multiplied in float32 before
        the cast back."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        # The fused kernels (kernels.cpu_fused or kernels.gpu_fused), set by LlamaForCausalLM once
        # it knows the device; None: the torch form below.
        self.fused: ModuleType | None = None

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """With ``residual_delta``, the residual stream x is first updated in place (x += delta)."""
        if self.fused is not None and not self.unit_offset:
            return self.fused.rms_norm(x, self.weight, self.eps, residual_delta)
        if residual_delta is not None:
            x.add_(residual_delta)
        # Normalise in float32 then cast back before the weight, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class HeadRMSNorm(RMSNorm):
    """Qwen3's RMSNorm over each head of q or k, (tokens, heads, head_dim) in the torch form: it
    never takes the fused kernels, which norm whole rows."""


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim**-0.5
        self.rotary_dim = cfg.rotary_dims  # below head_dim: the rest of each head is not rotated
        self.q_norm = HeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = HeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None
        # Gemma: this layer's sliding window (None: full attention) and the scores' soft cap.
        self.window = cfg.layer_windows[index] if cfg.layer_windows else None
        self.softcap = cfg.attn_logit_softcap
        # Rotary embedding and the K/V store in one pass of the fused kernels (set by the model).
        self.fused: ModuleType | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.window is not None and metadata.windowed is not None:
            metadata = metadata.windowed  # this layer's K/V lives in the window pool
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm)
        if self.fused is not None:
            k_cache, v_cache = kv_cache
            self.fused.rope_and_store_kv(
                qkv, cos, sin_signed, metadata.slot_mapping, k_cache, v_cache, self.num_heads
            )
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            out = backend.forward(
                q,
                k,
                v,
                k_cache,
                v_cache,
                metadata,
                self.scale,
                kv_stored=True,
                window=self.window,
                softcap=self.softcap,
            )
            return self.o_proj(out.reshape(-1, self.q_size))
        # q and k rotated together in one pass: (num_tokens, num_heads + num_kv_heads, head_dim)
        qk = self._rotate(qkv, cos, sin_signed)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward_packed(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        lengths: list[int],
        sliding_window: int | None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Causal attention of each input over its own tokens only, inputs laid back to back, with no
        KV cache: what a decoder computes when it embeds (LlamaForCausalLM.encode). `last_only`:
        only each input's last token asks (one row per input)."""
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm)
        tokens = qkv.shape[0]
        qk = self._rotate(qkv, cos, sin_signed)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.num_kv_heads != self.num_heads:
            # K/V repeated per query head: SDPA's fused CPU kernel takes no grouped heads (with
            # enable_gqa it falls back to its unfused form, several times slower).
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows = len(lengths) if last_only else tokens
        out = torch.empty(rows, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for i, length in enumerate(lengths):
            end = start + length
            # (1, heads, length, head_dim) per input: attention never crosses inputs. Four
            # dimensions, or SDPA's CPU dispatch takes its unfused form.
            qi, ki, vi = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            if last_only:  # the last token sees every key of its input (its window's, with one)
                first = max(0, length - sliding_window) if sliding_window is not None else 0
                attended = F.scaled_dot_product_attention(
                    qi[:, :, -1:], ki[:, :, first:], vi[:, :, first:], scale=self.scale
                )
                out[i] = attended[0, :, 0]
                start = end
                continue
            if sliding_window is not None and length > sliding_window:
                positions = torch.arange(length, device=x.device)
                distance = positions[:, None] - positions[None, :]
                mask = (distance >= 0) & (distance < sliding_window)
                attended = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale)
            else:
                attended = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
            out[start:end] = attended[0].transpose(0, 1)
            start = end
        return self.o_proj(out.view(rows, self.q_size))

    def _rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """q and k of the fused projection, rotated: (num_tokens, num_heads + num_kv_heads, head_dim).
        With a partial rotary embedding only each head's first rotary_dim dims turn."""
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.rotary_dim == self.head_dim:
            return apply_rope_signed(qk, cos, sin_signed)
        turned = apply_rope_signed(qk[..., : self.rotary_dim], cos, sin_signed)
        return torch.cat((turned, qk[..., self.rotary_dim :]), dim=-1)

    def _norm_heads(self, qkv: torch.Tensor, q_norm: HeadRMSNorm, k_norm: HeadRMSNorm) -> None:
        """q and k normed per head in place in the fused projection, before the rotary embedding."""
        tokens, q_size, kv_size = qkv.shape[0], self.q_size, self.kv_size
        q = qkv[:, :q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        qkv[:, :q_size] = q_norm(q).view(tokens, q_size)
        qkv[:, q_size : q_size + kv_size] = k_norm(k).view(tokens, kv_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's gate; the fused kernels do SiLU
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused: ModuleType | None = None  # the fused kernels' silu_mul (set by LlamaForCausalLM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place on the fused projection's output, which nothing else holds: two fewer
        # (num_tokens, intermediate_size) temporaries per layer.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, index)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(cfg) if index in cfg.moe_layers else LlamaMLP(cfg)
        )
        norm = cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        # Gemma: the attention output is normed before the residual, the MLP's input and output too.
        self.pre_feedforward_layernorm = RMSNorm(*norm) if cfg.gemma else None
        self.post_feedforward_layernorm = RMSNorm(*norm) if cfg.gemma else None

    def forward(self, x, delta, cos, sin, kv_cache, metadata, backend) -> torch.Tensor:
        """Adds ``delta`` (the previous layer's MLP output, or None) to the residual stream x in
        place and returns this layer's MLP output, to be added by the next norm: each residual
        update rides along with the norm that reads it. x is this forward's own tensor (the
        embedding output), never a caller's."""
        attn = self.self_attn(self.input_layernorm(x, delta), cos, sin, kv_cache, metadata, backend)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            mlp_in = self.pre_feedforward_layernorm(x, self.post_attention_layernorm(attn))
            return self.post_feedforward_layernorm(self.mlp(mlp_in))
        return self.mlp(self.post_attention_layernorm(x, attn))

    def forward_packed(self, x, delta, cos, sin, lengths: list[int], window: int | None) -> torch.Tensor:
        """forward() without a KV cache, each input attending to itself alone (encode)."""
        attn = self.self_attn.forward_packed(self.input_layernorm(x, delta), cos, sin, lengths, window)
        return self.mlp(self.post_attention_layernorm(x, attn))

    def forward_last(self, x, delta, cos, sin, lengths: list[int], window: int | None):
        """forward_packed() for each input's last token only: (its residual stream, its MLP output),
        one row per input. The last layer of a last-token embedding needs no more."""
        attn = self.self_attn.forward_packed(
            self.input_layernorm(x, delta), cos, sin, lengths, window, last_only=True
        )
        ends = torch.tensor(lengths, device=x.device).cumsum(0) - 1
        x_last = x.index_select(0, ends)
        return x_last, self.mlp(self.post_attention_layernorm(x_last, attn))


# The widest step with prompt tokens that the one-call layers take: each prompt row attends as a
# decode (reading its keys on its own), which a narrow step pays for in saved dispatch; wider chunks
# keep the prefill attention kernel, whose tiles read each key once for many rows.
MIXED_MAX_ROWS = 16


def _rows_as_decodes(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, its sequence's block table and the context it attends (its position + 1): a
    prompt chunk's rows are decodes of their sequence, each over the keys up to its own, once the
    step's K/V is stored (the one-call layers store every row's before any attends). So a narrow
    step that computes a few prompt tokens beside decodes takes the one-call layers too."""
    if metadata.max_query_len == 1:
        return metadata.block_tables, metadata.seq_lens
    index: list[int] = []
    lens: list[int] = []
    for i, (query, context) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        index.extend([i] * query)
        lens.extend(range(context - query + 1, context + 1))
    device = metadata.block_tables.device
    rows = torch.tensor(index, dtype=torch.long, device=device)
    return metadata.block_tables.index_select(0, rows), torch.tensor(lens, dtype=torch.int32, device=device)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        """`max_model_len`: the longest context served (default: the model's), which picks
        LongRoPE's factors (engine.models.rope.uses_long_factors)."""
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.model = LlamaModel(cfg)
        self.long_rope = uses_long_factors(cfg.rope_scaling, max_model_len or cfg.max_model_len)
        self.rotary = RotaryEmbedding(
            cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling, long_context=self.long_rope
        )
        # Gemma 3's sliding layers turn by their own (unscaled) base.
        self.rotary_local = (
            RotaryEmbedding(cfg.rotary_dims, cfg.local_rope_theta, None)
            if cfg.local_rope_theta is not None
            else None
        )
        self._local_layers = [
            self.rotary_local is not None and cast(LlamaDecoderLayer, layer).self_attn.window is not None
            for layer in self.model.layers
        ]
        # Gemma scales the embedding by sqrt(hidden_size), rounded to the weights' dtype.
        self.embed_scale = cfg.hidden_size**0.5 if cfg.gemma else None
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # (2, num_positions, rotary_dim): cos, signed sin; the global table, then the local one
        self._rope_tables: list[torch.Tensor | None] = [None, None]
        self._fused_device: torch.device | None = None
        # oneDNN's packed copy of the logits weight for narrow batches, set by the loader on CPU.
        self.packed_logits_weight: torch.Tensor | None = None
        self.packed_max_rows = 0  # batches of up to this many rows use packed_logits_weight
        # Decode steps of up to cpu_decode_layer.max_rows(dtype) sequences on CPU in float32, and in
        # bfloat16 where the CPU has bfloat16 dot products: each layer in one C call (set by
        # _use_fused where the model's layers are the plain kind it computes).
        self._decode_layers: cpu_decode_layer.DecodeLayers | None = None
        # Called between decoder layers while set (engine.step_interrupt: a spare-capacity step may
        # be given up there).
        self.between_layers: Callable[[], None] | None = None
        self._decode_layers_linear: nn.Module | None = None  # the first layer's qkv_proj it read
        # Where the linears are LoRA's wrappers: their step, None while no row uses an adapter (the
        # one-call layers multiply by the base weights alone, so only such steps take them).
        self._decode_layers_lora: LoRAContext | None = None

    def _use_fused(self, device: torch.device) -> None:
        """Norms, MLP activations and the rotary embedding with the K/V store take the fused
        kernels: in C on CPU where they could be built, in Triton on a GPU."""
        if self._fused_device == device:
            return
        self._fused_device = device
        cfg = self.config
        dtype = self.model.embed_tokens.weight.dtype
        kernels: ModuleType | None = None
        if device.type == "cpu":
            if dtype in (torch.float32, torch.bfloat16) and cfg.head_dim <= 512 and cpu_fused.available():
                kernels = cpu_fused
        elif device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16):
            from kernels import gpu_fused

            kernels = gpu_fused
        for module in self.modules():
            if isinstance(module, HeadRMSNorm):
                continue
            if isinstance(module, RMSNorm | LlamaMLP | SparseMoeBlock):
                module.fused = kernels
            elif isinstance(module, LlamaAttention):
                # On CPU the store is the torch backend's first act; the Triton backend under the
                # interpreter keeps its own. On a GPU both take the stored K/V. The fused rotary
                # embedding turns whole heads: a partial one takes the torch form.
                on = (
                    kernels is not None
                    and (device.type == "cuda" or isinstance(self.backend, TorchAttentionBackend))
                    and module.rotary_dim == module.head_dim
                )
                module.fused = kernels if on else None
        self._decode_layers = (
            self._make_decode_layers()
            if kernels is cpu_fused and cpu_decode_layer.max_rows(dtype) > 0
            else None
        )

    def _make_decode_layers(self) -> cpu_decode_layer.DecodeLayers | None:
        """The layers as one C call each for decode steps (kernels.cpu_decode_layer),
        where every layer is the plain kind that kernel computes: dense SwiGLU MLP, whole-head
        rotary embedding, no sliding window, soft cap, head norms or Gemma norms, plain linears
        or LoRA's wrappers of them (a step with an adapter's rows keeps the layer-by-layer path),
        and the torch attention backend.
        PAGODA_CPU_DECODE_LAYER=0 keeps the layer-by-layer path."""
        cfg = self.config
        if (
            os.environ.get("PAGODA_CPU_DECODE_LAYER", "1") == "0"
            or cfg.gemma
            or cfg.qk_norm
            or cfg.attn_logit_softcap
            or self.rotary_local is not None
            or not isinstance(self.backend, TorchAttentionBackend)
            or not cpu_decode_layer.available()
        ):
            return None
        weights: list[cpu_decode_layer.LayerWeights] = []
        layers = [cast(LlamaDecoderLayer, layer) for layer in self.model.layers]
        contexts: set[int] = set()
        lora: LoRAContext | None = None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, LlamaMLP):
                return None
            linears: list[nn.Module] = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            for i, linear in enumerate(linears):
                if isinstance(linear, LoRALinear):
                    lora = linear.context
                    contexts.add(id(lora))
                    linears[i] = linear.base
            if not all(isinstance(m, nn.Linear) for m in linears):
                return None
            plain = cast(list[nn.Linear], linears)
            if (
                mlp.gelu
                or attn.window is not None
                or attn.rotary_dim != attn.head_dim
                or layer.input_layernorm.unit_offset
                or layer.pre_feedforward_layernorm is not None
                or any(m.bias is not None for m in plain[1:])
                or not all(m.weight.is_contiguous() for m in plain)
            ):
                return None
            qkv, o, gate_up, down = plain
            weights.append(
                cpu_decode_layer.LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    post_attention_norm=layer.post_attention_layernorm.weight,
                    qkv=qkv.weight,
                    qkv_bias=qkv.bias,
                    o=o.weight,
                    gate_up=gate_up.weight,
                    down=down.weight,
                )
            )
        if len(contexts) > 1:  # every wrapper reads one step's mapping
            return None
        first = layers[0].self_attn
        self._decode_layers_linear = first.qkv_proj
        self._decode_layers_lora = lora
        return cpu_decode_layer.DecodeLayers(
            weights,
            eps=cfg.rms_norm_eps,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            scale=first.scale,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, hidden_size), after the final norm
        x = self._embed(input_ids)
        self._use_fused(x.device)
        tables = [self._cos_sin(positions, metadata.max_seq_len, x.dtype)]
        if self.rotary_local is not None:
            tables.append(self._cos_sin(positions, metadata.max_seq_len, x.dtype, local=True))
        fast = self._decode_layers
        lora = self._decode_layers_lora
        if (
            fast is not None
            and x.shape[0]
            <= (fast.max_rows if metadata.max_query_len == 1 else min(fast.max_rows, MIXED_MAX_ROWS))
            and metadata.windowed is None
            and (lora is None or lora.step is None)
            and cast(LlamaDecoderLayer, self.model.layers[0]).self_attn.qkv_proj is self._decode_layers_linear
        ):  # (the last: no LoRA wrapper has replaced the linears the kernel reads since)
            cos, sin_signed = tables[0]
            block_tables, seq_lens = _rows_as_decodes(metadata)
            hidden = fast.forward(
                x, cos, sin_signed, kv_caches, metadata.slot_mapping, block_tables, seq_lens,
                between=self.between_layers,
            )  # fmt: skip
            return self.model.norm(x, hidden)
        delta = None
        between = self.between_layers
        for i, (layer, kv_cache, local) in enumerate(
            zip(self.model.layers, kv_caches, self._local_layers, strict=True)
        ):
            if i and between is not None:
                between()
            cos, sin_signed = tables[1 if local else 0]
            delta = layer(x, delta, cos, sin_signed, kv_cache, metadata, self.backend)
        return self.model.norm(x, delta)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, lengths: list[int], last_only: bool = False) -> torch.Tensor:
        """Final-norm token states (tokens, hidden_size) of inputs laid back to back, `lengths` tokens
        each, every input attending causally to itself alone and from position 0, with no KV cache:
        what an embedding model built on this decoder pools (engine.embedding_engine). `last_only`:
        each input's last token's state alone, (inputs, hidden_size); the last layer then computes
        its attention output and MLP for those rows only. Not Gemma's: its windows, caps and extra
        norms are not computed here (engine.rules.model_tasks never makes it an embedding model)."""
        if self.config.gemma:
            raise NotImplementedError("Gemma models generate only; they do not embed")
        x = self._embed(input_ids)
        self._use_fused(x.device)
        positions = torch.cat([torch.arange(n, device=x.device) for n in lengths])
        cos, sin_signed = self._cos_sin(positions, max(lengths), x.dtype)
        window = self.config.sliding_window
        delta = None
        layers = [cast(LlamaDecoderLayer, layer) for layer in self.model.layers]
        for layer in layers[:-1] if last_only else layers:
            delta = layer.forward_packed(x, delta, cos, sin_signed, lengths, window)
        if last_only:
            x, delta = layers[-1].forward_last(x, delta, cos, sin_signed, lengths, window)
        return self.model.norm(x, delta)

    def _cos_sin(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see apply_rope_signed) of each position, (num_tokens, head_dim) each,
        read from a table of every position below the longest context seen so far: one gather per
        step instead of recomputing the angles."""
        table = self._rope_tables[1 if local else 0]
        if (
            table is None
            or table.shape[1] < max_len
            or table.dtype != dtype
            or table.device != positions.device
        ):
            # Doubling, so that growing contexts rebuild it a logarithmic number of times. A CUDA
            # graph is captured after a warm-up forward at max_model_len, so it never rebuilds.
            size = max(max_len, 256, 2 * table.shape[1] if table is not None else 0)
            rotary = self.rotary_local if local and self.rotary_local is not None else self.rotary
            cos, sin = rotary.cos_sin(torch.arange(size, device=positions.device), dtype)
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            table = self._rope_tables[1 if local else 0] = torch.stack((cos, sin_signed))
        cos_sin = table.index_select(1, positions)  # (2, num_tokens, head_dim)
        return cos_sin[0], cos_sin[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, vocab_size), float32
        packed = self.packed_logits_weight
        if packed is not None and 0 < hidden.shape[0] <= self.packed_max_rows:
            logits = packed_linear(hidden, packed, None).float()
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits
