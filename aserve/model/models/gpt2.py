"""GPT-2 (`GPT2LMHeadModel`): pre-LN blocks of multi-head attention with learned absolute positions
(no rotary), LayerNorms, a fused q|k|v projection with biases, a non-gated MLP (`gelu_new`) and an LM
head tied to the token embedding unless the config says otherwise.

The checkpoint's projections are transformers' `Conv1D` (weights stored `[in, out]`); they are
`Conv1DLinear` layers here, which transpose at load. Module names follow the checkpoint's under
`model.` instead of `transformer.` (some GPT-2 checkpoints have no prefix at all: `h.0.attn...`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend, AttentionMetadata
from aserve.model.layers.activation import get_act_fn
from aserve.model.layers.attention import Attention
from aserve.model.layers.embedding import LMHead, PositionEmbedding, VocabEmbedding
from aserve.model.layers.linear import Conv1DLinear, MergedConv1DLinear
from aserve.model.layers.norm import LayerNorm
from aserve.model.models.base import CausalLM


class GPT2Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        fields = arch.family
        hidden, q_size = arch.hidden_size, arch.num_attention_heads * arch.head_dim  # q_size: this rank's heads
        self.c_attn = MergedConv1DLinear(hidden, [q_size] * 3, bias=True, dtype=dtype)
        self.c_proj = Conv1DLinear(q_size, hidden, bias=True, dtype=dtype)
        scale = arch.head_dim**-0.5 if fields.scale_attn_weights else 1.0
        if fields.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(arch.num_attention_heads, arch.head_dim, arch.num_attention_heads, scale, backend)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(hidden))
        return self.c_proj(self.attn(q, k, v, meta))


class GPT2MLP(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.c_fc = Conv1DLinear(arch.hidden_size, arch.intermediate_size, bias=True, dtype=dtype)
        self.act = get_act_fn(arch.family.activation_function)
        self.c_proj = Conv1DLinear(arch.intermediate_size, arch.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        eps = arch.family.layer_norm_epsilon
        self.ln_1 = LayerNorm(arch.hidden_size, eps, dtype=dtype)
        self.attn = GPT2Attention(arch, layer_idx, backend, dtype)
        self.ln_2 = LayerNorm(arch.hidden_size, eps, dtype=dtype)
        self.mlp = GPT2MLP(arch, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.ln_1(hidden)
        else:
            hidden, residual = self.ln_1(hidden, residual)
        hidden = self.attn(hidden, meta)
        hidden, residual = self.ln_2(hidden, residual)
        return self.mlp(hidden), residual


class GPT2Model(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.wte = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.wpe = PositionEmbedding(arch.max_position_embeddings, arch.hidden_size, dtype=dtype)
        self.h = nn.ModuleList(GPT2Block(arch, i, backend, dtype)
                               for i in range(arch.first_layer, arch.first_layer + arch.num_hidden_layers))
        self.ln_f = LayerNorm(arch.hidden_size, arch.family.layer_norm_epsilon, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        residual = None
        for block in self.h:
            hidden, residual = block(hidden, residual, meta)
        hidden, _ = self.ln_f(hidden, residual)
        return hidden


class GPT2LMHeadModel(CausalLM):
    # Both c_proj layers (attention output, MLP output) feed the residual add and a LayerNorm only.
    float_output_modules: ClassVar[tuple[str, ...]] = ("c_proj",)
    column_parallel_modules: ClassVar[tuple[str, ...]] = ("c_attn", "c_fc")
    row_parallel_modules: ClassVar[tuple[str, ...]] = ("c_proj",)
    qkv_modules: ClassVar[tuple[str, ...]] = ("c_attn",)
    # transformers' causal-mask buffers, stored by older checkpoints.
    _BUFFERS: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        with torch.device(device):
            self.model = GPT2Model(arch, backend, dtype)
            tie = self.model.wte if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)

    def checkpoint_name(self, name: str) -> str | None:
        """`transformer.h.0.attn.c_attn.weight` (or unprefixed `h.0...`) -> `model.h.0.attn.c_attn.weight`;
        the attention-mask buffers are skipped."""
        if name.endswith(self._BUFFERS):
            return None
        if name.startswith("lm_head."):
            return name
        return "model." + name.removeprefix("transformer.")
