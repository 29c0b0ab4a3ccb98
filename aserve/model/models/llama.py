"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3): pre-norm blocks of GQA attention with
rotary positions and a gated-SiLU MLP. The model classes only compose layers and declare how their
attention differs (`LlamaAttentionOptions`); the plumbing is `CausalLM`'s.

Differences: Qwen2 has biases on q/k/v (not o_proj); Llama with `attention_bias` has them on q/k/v
and o_proj; Qwen3 normalizes each head of q and k (RMSNorm over head_dim) before the rotary; any
member may tie the LM head to the embedding, and each layer has its own attention window
(`ArchConfig.layer_sliding_windows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend, AttentionMetadata
from aserve.model.layers.activation import get_act_and_mul
from aserve.model.layers.attention import Attention, split_qkv_heads
from aserve.model.layers.embedding import LMHead, VocabEmbedding
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.layers.norm import RMSNorm
from aserve.model.layers.rotary import RotaryEmbedding
from aserve.model.models.base import QKV_GATE_UP_MAPPING, CausalLM


@dataclass(frozen=True)
class LlamaAttentionOptions:
    """How a family's attention block differs from Llama's."""

    o_proj_bias: bool = True  # with `attention_bias`: o_proj has a bias too (Qwen2: only q/k/v)
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary (Qwen3)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, options: LlamaAttentionOptions, rotary: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, [q_size, kv_size, kv_size], bias=arch.attention_bias,
                                     dtype=dtype)
        self.o_proj = Linear(q_size, arch.hidden_size, bias=arch.attention_bias and options.o_proj_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype=dtype) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype=dtype) if options.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, backend,
                              sliding_window=arch.sliding_window_of(layer_idx))

    def forward(self, cos_sin: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`cos_sin`: the step's rotary rows (`RotaryEmbedding.cos_sin(positions)`)."""
        q, k, v = split_qkv_heads(self.qkv_proj(hidden), self.qkv_proj.split, self.num_heads, self.num_kv_heads,
                                  self.head_dim, self.q_norm, self.k_norm)
        num_tokens = hidden.shape[0]
        q, k = self.rotary(cos_sin, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, intermediate_size: int | None = None):
        """`intermediate_size`: the MLP's width (default `arch.intermediate_size`; an MoE shared expert's own)."""
        super().__init__()
        width = intermediate_size or arch.intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, [width] * 2, dtype=dtype)
        self.down_proj = Linear(width, arch.hidden_size, dtype=dtype)
        self.act_fn = get_act_and_mul(arch.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, options: LlamaAttentionOptions, rotary: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (`x [T, H] -> [T, H]`; default `LlamaMLP`, an MoE block in MoE families)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(arch, layer_idx, options, rotary, backend, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.mlp = mlp if mlp is not None else LlamaMLP(arch, dtype)

    def forward(self, cos_sin: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, options: LlamaAttentionOptions, backend: AttentionBackend,
                 dtype: torch.dtype, rotary_dim: int | None = None,
                 mlp_factory: Callable[[int], nn.Module | None] | None = None):
        """`rotary_dim`: how many leading dims of each head the rotary turns (default: all; Phi-3's
        `partial_rotary_factor` turns fewer). `mlp_factory(layer_idx)`: that layer's feed-forward block
        (None: `LlamaMLP`)."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        # One cos/sin table shared by every layer.
        self.rotary = RotaryEmbedding(arch.head_dim, rotary_dim or arch.head_dim, arch.max_position_embeddings,
                                      arch.rope_theta, arch.rope_scaling, is_neox=True, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, options, self.rotary, backend, dtype, mlp_factory(i) if mlp_factory else None)
            for i in range(arch.first_layer, arch.first_layer + arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)  # looked up once, shared by every layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = QKV_GATE_UP_MAPPING
    float_output_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj", "gate_up_proj")
    attention_options: ClassVar[LlamaAttentionOptions] = LlamaAttentionOptions()

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        with torch.device(device):
            self.model = LlamaModel(arch, self.attention_options, backend, dtype)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window (read from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases and none on o_proj (ArchConfig.attention_bias defaults to True for Qwen2)."""

    attention_options = LlamaAttentionOptions(o_proj_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with q and k normalized per head before the rotary; biases as `attention_bias` says."""

    attention_options = LlamaAttentionOptions(qk_norm=True)
