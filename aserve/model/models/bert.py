"""BERT encoders (all-MiniLM, bge, cross-encoders): post-norm blocks of bidirectional multi-head
attention and a GELU MLP over word + learned absolute position + token-type embeddings.

`BertModel` gives the encoder's last hidden states (pooled outside, aserve/model/pooling/);
`BertForSequenceClassification` adds the pooler (dense + tanh on the CLS row) and the classifier.
Attention is bidirectional over a packed batch of whole sequences (`EncoderMetadata`,
aserve/model/attention/bidirectional.py); there is no KV cache and no LM head. Weight loading is
`CausalLM`'s (packed q|k|v, the completeness check), borrowed by `EncoderModel`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.model.attention.bidirectional import (
    EncoderAttentionBackend,
    EncoderMetadata,
    TorchEncoderAttentionBackend,
)
from aserve.model.layers.activation import get_act_fn
from aserve.model.layers.embedding import PositionEmbedding, VocabEmbedding
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.layers.norm import LayerNorm
from aserve.model.models.base import CausalLM


class EncoderModel(nn.Module):
    """The family-neutral half of an encoder-only model: `forward(input_ids [T], positions [T] | None,
    meta: EncoderMetadata, token_type_ids [T] | None) -> hidden [T, hidden]` (the last layer's output,
    in the model dtype), and `load_weights` with `CausalLM`'s conventions (packed-module mapping,
    `checkpoint_name`, a completeness check). No KV cache, no LM head; tensor parallelism is not
    implemented (every layer replicated)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    expert_params_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {}
    float_output_modules: ClassVar[tuple[str, ...]] = ()
    column_parallel_modules: ClassVar[tuple[str, ...]] = ()
    row_parallel_modules: ClassVar[tuple[str, ...]] = ()
    qkv_modules: ClassVar[tuple[str, ...]] = ()
    ignored_suffixes: ClassVar[tuple[str, ...]] = ()
    lm_head = None  # an encoder has none (read by the shared weight loader and the CPU Linear forms)
    is_encoder = True

    load_weights = CausalLM.load_weights
    _check_complete = CausalLM._check_complete
    _load_expert_tensor = CausalLM._load_expert_tensor
    _missing_expert_tensors = CausalLM._missing_expert_tensors

    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.arch = arch
        self.dtype = dtype

    def checkpoint_name(self, name: str) -> str | None:
        return name


# BERT checkpoint projection -> (aserve's fused layer, shard index).
BERT_QKV_MAPPING: dict[str, tuple[str, int]] = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1),
                                                "value": ("qkv_proj", 2)}


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        fields = arch.family
        self.word_embeddings = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.position_embeddings = PositionEmbedding(arch.max_position_embeddings, arch.hidden_size, dtype=dtype)
        self.token_type_embeddings = (VocabEmbedding(fields.type_vocab_size, arch.hidden_size, dtype=dtype)
                                      if fields.type_vocab_size > 0 else None)
        self.LayerNorm = LayerNorm(arch.hidden_size, fields.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            hidden = hidden + self.token_type_embeddings(types)
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class BertSelfOutput(nn.Module):
    """`LayerNorm(dense(x) + residual)`; also the MLP's output block (`BertOutput`)."""

    def __init__(self, in_size: int, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(in_size, arch.hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = LayerNorm(arch.hidden_size, arch.family.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        normed, _ = self.LayerNorm(self.dense(x), residual)
        return normed


class BertAttention(nn.Module):
    def __init__(self, arch: ArchConfig, backend: EncoderAttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        size = self.num_heads * self.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, [size] * 3, bias=True, dtype=dtype)
        self.output = BertSelfOutput(size, arch, dtype)
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = (x.reshape(num_tokens, self.num_heads, self.head_dim) for x in self.qkv_proj.split(self.qkv_proj(hidden)))
        context = self.backend.forward(q, k, v, meta, self.scale).reshape(num_tokens, -1)
        return self.output(context, hidden)


class BertIntermediate(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(arch.hidden_size, arch.intermediate_size, bias=True, dtype=dtype)
        self.act_fn = get_act_fn(arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, arch: ArchConfig, backend: EncoderAttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(arch, backend, dtype)
        self.intermediate = BertIntermediate(arch, dtype)
        self.output = BertSelfOutput(arch.intermediate_size, arch, dtype)

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        attended = self.attention(hidden, meta)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, arch: ArchConfig, backend: EncoderAttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch, backend, dtype) for _ in range(arch.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, meta)
        return hidden


class BertPooler(nn.Module):
    """`tanh(dense(cls_hidden))`: BERT's pooled output, the cross-encoder classifier's input."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(arch.hidden_size, arch.hidden_size, bias=True, dtype=dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertBackbone(nn.Module):
    """Embeddings and encoder layers (+ the pooler for the classification head)."""

    def __init__(self, arch: ArchConfig, backend: EncoderAttentionBackend, dtype: torch.dtype, with_pooler: bool):
        super().__init__()
        self.embeddings = BertEmbeddings(arch, dtype)
        self.encoder = BertEncoder(arch, backend, dtype)
        self.pooler = BertPooler(arch, dtype) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), meta)


class BertModel(EncoderModel):
    """The encoder's last hidden states `[T, hidden]` for a packed batch (see `EncoderModel`).

    `backend` (the loader's paged backend) is not used: an encoder keeps no cache; attention runs on
    `encoder_backend` (default `TorchEncoderAttentionBackend`). Checkpoint names with or without the
    `bert.` prefix load; BERT's own pooler and pre-training heads (`pooler.*`, `cls.*`) are skipped."""

    packed_modules_mapping = BERT_QKV_MAPPING
    with_pooler: ClassVar[bool] = False

    def __init__(self, arch: ArchConfig, backend: object = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", encoder_backend: EncoderAttentionBackend | None = None):
        super().__init__(arch, dtype)
        self.encoder_backend = encoder_backend or TorchEncoderAttentionBackend()
        with torch.device(device):
            self.bert = BertBackbone(arch, self.encoder_backend, dtype, self.with_pooler)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's position in its own sequence (None: `meta.positions()`);
        `token_type_ids`: segment ids (None: all 0)."""
        if positions is None:
            positions = meta.positions()
        return self.bert(input_ids, positions, meta, token_type_ids)

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("bert.")
        if name.startswith("cls.") or name == "embeddings.position_ids":
            return None
        if name.startswith("pooler.") and not self.with_pooler:
            return None
        if name.endswith((".gamma", ".beta")):  # old TF-converted checkpoints' LayerNorm names
            name = name[:-len("gamma")] + "weight" if name.endswith(".gamma") else name[:-len("beta")] + "bias"
        return "bert." + name.replace(".attention.self.", ".attention.")


class BertForSequenceClassification(BertModel):
    """A cross-encoder / classifier: `forward` as `BertModel`; `classify(cls_hidden [N, hidden]) ->
    logits [N, num_labels]` float32 (BERT's pooler, then the classifier), the CLS rows coming from
    the pooling layer (aserve/model/pooling/pooler.py)."""

    with_pooler = True

    def __init__(self, arch: ArchConfig, backend: object = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", encoder_backend: EncoderAttentionBackend | None = None):
        super().__init__(arch, backend, dtype, device, encoder_backend)
        with torch.device(device):
            self.classifier = Linear(arch.hidden_size, arch.family.num_labels, bias=True, dtype=dtype)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(cls_hidden)).float()

    def checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith("classifier.") else super().checkpoint_name(name)
