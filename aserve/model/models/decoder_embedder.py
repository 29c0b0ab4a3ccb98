"""Decoder embedders (Qwen3-Embedding, gte-Qwen2 style): a supported causal family serving its final
normed hidden states for pooling (LAST, normalized, by default: aserve/config/pooler.py) instead
of logits. The forward, the paged KV cache (so chunked prefill and prefix caching still apply) and the
weights are the causal model's; only the LM head is gone.
"""

from __future__ import annotations

import torch

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend
from aserve.model.models.base import CausalLM

_EMBEDDER_CLASSES: dict[type[CausalLM], type[CausalLM]] = {}


def decoder_embedder_class(causal_cls: type[CausalLM]) -> type[CausalLM]:
    """`causal_cls` without its LM head: `forward(input_ids, positions, meta) -> hidden [T, hidden]` as
    the causal model's (final norm applied); `compute_logits` raises. Loads checkpoints saved from the
    bare decoder (`*Model`: names without the `model.` prefix) and causal ones (`lm_head.*` skipped)."""
    cached = _EMBEDDER_CLASSES.get(causal_cls)
    if cached is not None:
        return cached

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        causal_cls.__init__(self, arch, backend, dtype, device)
        self.lm_head = None  # what the shared loader and the CPU Linear forms read as "no head"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is an embedding model: it has no LM head")

    def checkpoint_name(self, name: str) -> str | None:
        name = causal_cls.checkpoint_name(self, name if name.startswith(("model.", "lm_head.")) else f"model.{name}")
        return None if name is None or name.startswith("lm_head.") else name

    cls = type(f"{causal_cls.__name__.removesuffix('ForCausalLM')}EmbeddingModel", (causal_cls,),
               {"__init__": __init__, "compute_logits": compute_logits, "checkpoint_name": checkpoint_name,
                "__doc__": f"{causal_cls.__name__}'s decoder serving hidden states for pooling.",
                "__module__": __name__, "is_encoder": False})
    _EMBEDDER_CLASSES[causal_cls] = cls
    return cls
