"""Llama-family decoder (Llama, Mistral, Qwen2): composes layers; weight fusing lives in `load_weights`.

Family differences come from `ArchConfig`: Qwen2 has biases on q/k/v (not o_proj), Llama with
`attention_bias` has them on q/k/v and o_proj, Mistral may use a sliding window, and any member may
tie the LM head to the embedding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend, AttentionMetadata, DecodeInputs
from aserve.model.layers.activation import get_act_and_mul
from aserve.model.layers.attention import Attention
from aserve.model.layers.embedding import LMHead, VocabEmbedding
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.layers.norm import RMSNorm
from aserve.model.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, [q_size, kv_size, kv_size], bias=arch.attention_bias,
                                     dtype=dtype)
        o_bias = arch.attention_bias and arch.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(q_size, arch.hidden_size, bias=o_bias, dtype=dtype)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, backend)

    def forward(self, cos_sin: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`cos_sin`: the step's rotary rows (`RotaryEmbedding.cos_sin(positions)`)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        num_tokens = hidden.shape[0]
        q, k = self.rotary(cos_sin, q.view(num_tokens, self.num_heads, self.head_dim),
                           k.view(num_tokens, self.num_kv_heads, self.head_dim))
        out = self.attn(q.view(num_tokens, -1), k.view(num_tokens, -1), v, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedLinear(arch.hidden_size, [arch.intermediate_size] * 2, dtype=dtype)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, dtype=dtype)
        self.act_fn = get_act_and_mul(arch.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(arch, rotary, backend, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(arch, dtype)

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
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        # One cos/sin table shared by every layer.
        self.rotary = RotaryEmbedding(arch.head_dim, arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling, is_neox=True, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, self.rotary, backend, dtype) for _ in range(arch.num_hidden_layers)
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


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]`;
    `compute_logits(hidden [N, hidden]) -> [N, vocab]` float32."""

    # Checkpoint projection name -> (fused module name, shard index).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Projections whose output only feeds an RMSNorm (through the residual add) or the gated activation,
    # which take float32 rows on CPU: the loader may let these return unrounded float32
    # (aserve/model/quantization/cpu_kernel.py).
    float_output_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj", "gate_up_proj")
    # Checkpoint entries that carry no weights we use.
    ignored_suffixes = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.backend = backend
        with torch.device(device):
            self.model = LlamaModel(arch, backend, dtype)
            tie = self.model.embed_tokens if arch.tie_word_embeddings else None
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype=dtype, tie_to=tie)
        self.sliding_window = arch.sliding_window

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One cache tensor per layer, `[2, num_blocks, block_size, KVH, head_dim]` (see attention/base.py)."""
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}")
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.bind_kv_cache(cache)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | DecodeInputs) -> torch.Tensor:
        """The model's own sliding window (from its config) overrides `meta.sliding_window`.
        `DecodeInputs` (a compiled decode, already planned with that window) go to the layers as they are."""
        if isinstance(meta, AttentionMetadata):
            if meta.sliding_window != self.sliding_window:
                meta = dataclasses.replace(meta, sliding_window=self.sliding_window)
            begin_forward = getattr(self.backend, "begin_forward", None)
            if begin_forward is not None:  # optional hook: lets the backend plan once per step
                begin_forward(meta)
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up into their merged layers.

        Returns the names of the parameters loaded. Raises ValueError on an unknown name or a shape
        mismatch, and on parameters the checkpoint did not provide (a tied LM head needs none).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            if name == "lm_head.weight" and self.lm_head.tied:
                continue  # some tied checkpoints still store a copy of the embedding
            target, shard_id = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.packed_modules_mapping:
                fused, shard_id = self.packed_modules_mapping[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not match any parameter of "
                                 f"{self.arch.architecture} (is the config right for these weights?)")
            module = modules[target.rsplit(".", 1)[0]]
            try:
                module.load_shard(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        self._check_complete(loaded, params, modules)
        return loaded

    def _check_complete(self, loaded: set[str], params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.lm_head.tied:
                continue
            module = modules[name.rsplit(".", 1)[0]]
            if isinstance(module, MergedLinear) and name not in loaded:
                missing += [f"{name}#{i}" for i in range(len(module.output_sizes)) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window (read from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (ArchConfig.attention_bias defaults to True for Qwen2)."""
