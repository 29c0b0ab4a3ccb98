"""Gemma 2 and Gemma 3 (text) decoders: composes layers; family fields come from `GemmaFields`.

Both: embeddings scaled by sqrt(hidden_size), `(1 + w)` RMSNorms before and after both the attention
and the MLP, a GeGLU MLP, attention scaled by `query_pre_attn_scalar ** -0.5`, sliding-window and
global layers alternating (`ArchConfig.layer_sliding_windows`), tied LM head. Gemma 2 caps the
attention scores and the final logits (`cap * tanh(x / cap)`); Gemma 3 instead normalizes each head
of q and k, and its sliding layers use their own RoPE base.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.config.families import GemmaFields
from aserve.model.attention.base import AttentionBackend, AttentionMetadata
from aserve.model.layers.activation import get_act_and_mul
from aserve.model.layers.attention import Attention, split_qkv_heads
from aserve.model.layers.embedding import LMHead, VocabEmbedding
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.layers.norm import GemmaRMSNorm
from aserve.model.layers.rotary import RotaryEmbedding
from aserve.model.models.base import QKV_GATE_UP_MAPPING, CausalLM


class GemmaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, fields: GemmaFields, layer_idx: int, backend: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, [q_size, kv_size, kv_size], bias=arch.attention_bias,
                                     dtype=dtype)
        self.o_proj = Linear(q_size, arch.hidden_size, bias=arch.attention_bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, dtype=dtype) if fields.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, dtype=dtype) if fields.qk_norm else None
        window = arch.sliding_window_of(layer_idx)
        self.is_sliding = window is not None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, fields.query_pre_attn_scalar**-0.5,
                              backend, sliding_window=window, logit_softcap=fields.attn_logit_softcap)

    def forward(self, rotary: RotaryEmbedding, cos_sin: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_qkv_heads(self.qkv_proj(hidden), self.qkv_proj.split, self.num_heads, self.num_kv_heads,
                                  self.head_dim, self.q_norm, self.k_norm)
        num_tokens = hidden.shape[0]
        q, k = rotary(cos_sin, q, k)
        return self.o_proj(self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, meta))


class GemmaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedLinear(arch.hidden_size, [arch.intermediate_size] * 2, dtype=dtype)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, dtype=dtype)
        self.act_fn = get_act_and_mul(arch.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """`residual + post_attn(attn(input(x)))`, then `residual + post_ff(mlp(pre_ff(x)))`; the residual
    adds are fused into the next norm (`norm(x, residual)`), as in the Llama layers."""

    def __init__(self, arch: ArchConfig, fields: GemmaFields, layer_idx: int, backend: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype=dtype)
        self.self_attn = GemmaAttention(arch, fields, layer_idx, backend, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype)
        self.mlp = GemmaMLP(arch, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype)

    def forward(self, rotary: RotaryEmbedding, cos_sin: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rotary, cos_sin, hidden, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, arch: ArchConfig, fields: GemmaFields, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.embed_scale = arch.hidden_size**0.5  # applied in the activations' dtype, as Hugging Face does
        self.rotary = RotaryEmbedding(arch.head_dim, arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling, is_neox=True, dtype=dtype)
        self.local_rotary = None  # Gemma 3's sliding layers: their own base, no scaling
        if fields.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(arch.head_dim, arch.head_dim, arch.max_position_embeddings,
                                                fields.local_rope_theta, None, is_neox=True, dtype=dtype)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(arch, fields, i, backend, dtype)
            for i in range(arch.first_layer, arch.first_layer + arch.num_hidden_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        cos_sin = self.rotary.cos_sin(positions)
        local = self.local_rotary
        local_cos_sin = local.cos_sin(positions) if local is not None else cos_sin
        residual = None
        for layer in self.layers:
            if local is not None and layer.self_attn.is_sliding:
                hidden, residual = layer(local, local_cos_sin, hidden, residual, meta)
            else:
                hidden, residual = layer(self.rotary, cos_sin, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(CausalLM):
    packed_modules_mapping = QKV_GATE_UP_MAPPING

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        fields: GemmaFields = arch.family
        self.final_logit_softcap = fields.final_logit_softcap
        with torch.device(device):
            self.model = GemmaModel(arch, fields, backend, dtype)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: per-head q/k norms and a local RoPE base (both from `GemmaFields`)."""
