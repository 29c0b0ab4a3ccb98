"""OPT (`OPTForCausalLM`): multi-head attention with learned absolute positions (the table's rows
start at offset 2), LayerNorms before (pre-LN: opt-125m and most sizes) or after (post-LN: opt-350m)
each sub-block, a ReLU MLP (fc1/fc2), biases as `enable_bias` says, and an LM head tied to the token
embedding. Where the embedding is narrower than the model (`word_embed_proj_dim`, opt-350m),
`project_in` / `project_out` map between the two widths.

Module names are the checkpoint's with `model.decoder.` (or a bare `decoder.`) shortened to `model.`;
q/k/v load into one fused `qkv_proj`.
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
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.layers.norm import LayerNorm
from aserve.model.models.base import CausalLM

OPT_POSITION_OFFSET = 2  # transformers' OPTLearnedPositionalEmbedding: position p is row p + 2
OPT_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT does not configure


class OPTAttention(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        hidden, bias = arch.hidden_size, arch.family.enable_bias
        q_size = arch.num_attention_heads * arch.head_dim  # this rank's heads
        self.qkv_proj = MergedLinear(hidden, [q_size] * 3, bias=bias, dtype=dtype)
        self.out_proj = Linear(q_size, hidden, bias=bias, dtype=dtype)
        self.attn = Attention(arch.num_attention_heads, arch.head_dim, arch.num_attention_heads,
                              arch.head_dim**-0.5, backend)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    """Pre-LN: `forward(hidden, residual)` carries the un-normed residual stream like Llama's layers.
    Post-LN: each sub-block's output is normed after its residual add, so the stream is the normed
    output itself (the residual returned is None)."""

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        fields = arch.family
        hidden, bias, affine = arch.hidden_size, fields.enable_bias, fields.layer_norm_elementwise_affine
        self.pre_norm = fields.do_layer_norm_before
        self.self_attn = OPTAttention(arch, backend, dtype)
        self.self_attn_layer_norm = LayerNorm(hidden, OPT_LAYER_NORM_EPS, affine, dtype=dtype)
        self.fc1 = Linear(hidden, arch.intermediate_size, bias=bias, dtype=dtype)
        self.act = get_act_fn(fields.activation_function)
        self.fc2 = Linear(arch.intermediate_size, hidden, bias=bias, dtype=dtype)
        self.final_layer_norm = LayerNorm(hidden, OPT_LAYER_NORM_EPS, affine, dtype=dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.pre_norm:
            hidden, _ = self.self_attn_layer_norm(self.self_attn(hidden, meta), hidden)
            hidden, _ = self.final_layer_norm(self.fc2(self.act(self.fc1(hidden))), hidden)
            return hidden, None
        if residual is None:
            residual = hidden
            hidden = self.self_attn_layer_norm(hidden)
        else:
            hidden, residual = self.self_attn_layer_norm(hidden, residual)
        hidden = self.self_attn(hidden, meta)
        hidden, residual = self.final_layer_norm(hidden, residual)
        return self.fc2(self.act(self.fc1(hidden))), residual


class OPTDecoder(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        fields = arch.family
        hidden, embed_dim = arch.hidden_size, fields.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(arch.vocab_size, embed_dim, dtype=dtype)
        self.embed_positions = PositionEmbedding(arch.max_position_embeddings, hidden, OPT_POSITION_OFFSET,
                                                 dtype=dtype)
        projected = embed_dim != hidden
        self.project_in = Linear(embed_dim, hidden, dtype=dtype) if projected else None
        self.project_out = Linear(hidden, embed_dim, dtype=dtype) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(arch, backend, dtype) for _ in range(arch.num_hidden_layers))
        # Post-LN models end on a norm already; pre-LN ones norm the residual stream once more.
        self.final_layer_norm = (LayerNorm(hidden, OPT_LAYER_NORM_EPS, fields.layer_norm_elementwise_affine,
                                           dtype=dtype) if fields.do_layer_norm_before else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, meta)
        if self.final_layer_norm is not None:
            hidden, _ = self.final_layer_norm(hidden, residual)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
    }
    # Both feed the residual add and a LayerNorm only (in pre-LN and post-LN alike).
    float_output_modules: ClassVar[tuple[str, ...]] = ("out_proj", "fc2")
    column_parallel_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "fc1")
    row_parallel_modules: ClassVar[tuple[str, ...]] = ("out_proj", "fc2")

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        with torch.device(device):
            self.model = OPTDecoder(arch, backend, dtype)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.family.word_embed_proj_dim, dtype=dtype, tie_to=tie)

    def checkpoint_name(self, name: str) -> str | None:
        """`model.decoder.layers.0.fc1.weight` (or `decoder.layers...`) -> `model.layers.0.fc1.weight`."""
        for prefix in ("model.decoder.", "decoder."):
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return name
