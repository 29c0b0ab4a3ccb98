"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's decoder (`LlamaModel`, its
attention options per family) whose feed-forward block is, on sparse layers, a `SparseMoeBlock`.

What differs is data: the attention options (Qwen2-MoE: q/k/v bias, none on o_proj; Qwen3-MoE: q/k
norm), the family fields (`MoeFields`: experts, top-k, renormalization, which layers are sparse,
Qwen2-MoE's shared expert) and the checkpoint names (`expert_params_mapping`; Mixtral's
`block_sparse_moe` read as `mlp`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.config.families import MoeFields
from aserve.model.attention.base import AttentionBackend
from aserve.model.layers.embedding import LMHead
from aserve.model.layers.linear import Linear
from aserve.model.layers.moe import FusedMoE, select_experts
from aserve.model.models.base import QKV_GATE_UP_MAPPING, CausalLM
from aserve.model.models.llama import LlamaAttentionOptions, LlamaMLP, LlamaModel


class SparseMoeBlock(nn.Module):
    """`x [T, H] -> [T, H]`: the router (`gate`) picks each token's experts, the routed experts' outputs
    are summed with their weights, plus (Qwen2-MoE) `sigmoid(shared_expert_gate(x)) * shared_expert(x)`."""

    def __init__(self, arch: ArchConfig, fields: MoeFields, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.renormalize = fields.num_experts_per_tok, fields.norm_topk_prob
        self.gate = Linear(arch.hidden_size, fields.num_experts, dtype=dtype)
        self.experts = FusedMoE(fields.num_experts, arch.hidden_size, fields.moe_intermediate_size, dtype)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Linear | None = None
        if fields.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(arch, dtype, fields.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(CausalLM):
    """A Llama decoder with `SparseMoeBlock`s on the layers `MoeFields.is_sparse` names (the others keep
    the dense MLP of `intermediate_size`)."""

    packed_modules_mapping = QKV_GATE_UP_MAPPING  # dense layers and shared experts in MoE models
    expert_params_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }
    float_output_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj", "gate_up_proj")
    attention_options: ClassVar[LlamaAttentionOptions] = LlamaAttentionOptions()

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        fields: MoeFields = arch.family

        def mlp(layer_idx: int) -> nn.Module | None:
            return SparseMoeBlock(arch, fields, dtype) if fields.is_sparse(layer_idx) else None

        with torch.device(device):
            self.model = LlamaModel(arch, self.attention_options, backend, dtype, mlp_factory=mlp)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)


class MixtralForCausalLM(MoeForCausalLM):
    """Every layer sparse; experts `w1` (gate), `w3` (up), `w2` (down) under `block_sparse_moe`;
    sliding window on every layer when the config sets one (as Mistral)."""

    expert_params_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {
        "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2's attention (q/k/v bias from `qkv_bias`, none on o_proj) and a sigmoid-gated shared expert."""

    attention_options = LlamaAttentionOptions(o_proj_bias=False)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3's attention (q and k normalized per head; biases as `attention_bias` says), no shared expert."""

    attention_options = LlamaAttentionOptions(qk_norm=True)
