"""Phi-3 (and Phi-4-mini): Llama's decoder (pre-norm RMSNorm blocks, GQA attention without biases,
gated-SiLU MLP) with three differences, all data:

- checkpoints store the projections already fused (`qkv_proj`, `gate_up_proj`, the same row order
  as our merged layers), so there is no packed-module mapping: each loads whole;
- the rotary may turn only the first `int(head_dim * partial_rotary_factor)` dims of each head
  (`Phi3Fields`, neox style);
- RoPE scaling is usually `longrope` (see `aserve.model.layers.rotary`), and `sliding_window` applies
  to every layer (`ArchConfig.layer_sliding_windows`), as in transformers 5.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend
from aserve.model.layers.embedding import LMHead
from aserve.model.models.base import CausalLM
from aserve.model.models.llama import LlamaAttentionOptions, LlamaModel


class Phi3ForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}  # fused in the checkpoint
    float_output_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj", "gate_up_proj")
    attention_options: ClassVar[LlamaAttentionOptions] = LlamaAttentionOptions()

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(arch, backend, dtype)
        rotary_dim = arch.family.rotary_dim(arch.head_dim)
        with torch.device(device):
            self.model = LlamaModel(arch, self.attention_options, backend, dtype, rotary_dim=rotary_dim)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)
