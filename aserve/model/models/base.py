"""The family-neutral half of every causal LM: KV-cache binding, the forward entry, logits, and
weight loading with packed-module and expert mappings and a completeness check.

A family file subclasses `CausalLM`, builds `self.model` (`forward(input_ids, positions, meta) ->
hidden`) and `self.lm_head` in `__init__`, and declares its mappings as class attributes; it never
re-implements the plumbing here. Attention layers are found by type, so any module layout works.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend, AttentionMetadata, DecodeInputs
from aserve.model.kv_scales import attention_owners, load_kv_scale
from aserve.model.layers.attention import Attention
from aserve.model.layers.linear import MergedLinear
from aserve.model.pipeline import stage_local_name


# The Llama-style checkpoint's separate projections -> (aserve's fused layer, shard index).
QKV_GATE_UP_MAPPING: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]`;
    `compute_logits(hidden [N, hidden]) -> [N, vocab]` float32."""

    # Checkpoint projection name -> (fused module name, shard index): `q_proj` -> ("qkv_proj", 0).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    # Per-expert checkpoint projection -> (stacked parameter, shard index or None): `<prefix>.experts.<e>.w1.weight`
    # -> expert e's shard 0 of `<prefix>.experts.gate_up_proj`, through the module's `load_expert_shard`.
    expert_params_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {}
    # Projections whose output only feeds a norm (through the residual add) or the gated activation,
    # which take float32 rows on CPU: the loader may let these return unrounded float32
    # (aserve/model/quantization/cpu_kernel.py).
    float_output_modules: ClassVar[tuple[str, ...]] = ()
    # Tensor parallelism (applied from outside by the loader, aserve/model/tensor_parallel.py), by a Linear's
    # short name: column-parallel layers split their output rows across ranks (a merged layer each part),
    # row-parallel ones their input columns (outputs all-reduced). Any other Linear is replicated. The
    # model builds every layer at the sizes of the rank's `ArchConfig` (aserve/config/parallel.py), so a
    # layer whose width comes from heads or the intermediate size must be named here.
    column_parallel_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "gate_up_proj")
    row_parallel_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj")
    # Column-parallel merged layers whose parts are q | k | v: with fewer KV heads than ranks, each KV head's
    # slice is shared by `tp / num_kv_heads` ranks.
    qkv_modules: ClassVar[tuple[str, ...]] = ("qkv_proj",)
    # Checkpoint entries that carry no weights we use.
    ignored_suffixes: ClassVar[tuple[str, ...]] = (
        "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    model: nn.Module
    lm_head: nn.Module

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.backend = backend

    # -- the step ---------------------------------------------------------------------------------
    @property
    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def uniform_sliding_window(self) -> int | None:
        """The window every attention layer shares (None: full attention everywhere). Raises
        ValueError when layers differ (a caller that plans one mask for all layers cannot serve it)."""
        windows = {attn.sliding_window for attn in self.attention_layers}
        if len(windows) > 1:
            raise ValueError(f"{self.arch.architecture}: layers use different attention windows "
                             f"{sorted(windows, key=str)}; this path needs one window for every layer")
        return windows.pop() if windows else None

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One cache tensor per attention layer, `[2, num_blocks, block_size, KVH, head_dim]`."""
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}")
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.bind_kv_cache(cache)

    def unbind_kv_caches(self) -> None:
        """Forgets every layer's cache tensor (sleep mode frees them); forward raises until bound again."""
        for attn in self.attention_layers:
            attn.kv_cache = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | DecodeInputs) -> torch.Tensor:
        if isinstance(meta, AttentionMetadata):
            begin_forward = getattr(self.backend, "begin_forward", None)
            if begin_forward is not None:  # optional hook: lets the backend plan once per step
                begin_forward(meta)
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's `argmax(compute_logits(hidden))` (the first on ties) where the head finds it without
        computing every logit (LMHead.greedy), else None. A family that transforms the head's logits
        (`compute_logits` overridden: soft-capping, scaling) always gets None."""
        if type(self).compute_logits is not CausalLM.compute_logits:
            return None
        return self.lm_head.greedy(hidden)

    # -- weights ----------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model's terms, or None to skip it. Families whose
        checkpoints use other module names override this; the default keeps the name."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors, fusing the packed projections into their merged layers and
        stacking per-expert tensors into their MoE layers (`expert_params_mapping`).

        Returns the names of the parameters loaded. Raises ValueError on an unknown name or a shape
        mismatch, and on parameters the checkpoint did not provide (a tied LM head needs none). fp8 KV-cache
        scales (`self_attn.k_scale`, ...) go to their attention layers (aserve/model/kv_scales.py).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        tied = getattr(self.lm_head, "tied", False)
        owners = attention_owners(self)
        stage = self.arch if self.arch.total_layers else None  # a pipeline stage holds some layers only
        for original, tensor in weights:
            local = original if stage is None else stage_local_name(original, stage)
            name = None if local is None else self.checkpoint_name(local)
            if name is None or name.endswith(self.ignored_suffixes):
                continue
            if name not in params and load_kv_scale(owners, original, name, tensor):  # fp8 KV scales: kv_scales.py
                continue
            if name == "lm_head.weight" and tied:
                continue  # some tied checkpoints still store a copy of the embedding
            target, shard_id = name, None
            parts = name.split(".")
            if len(parts) >= 4 and parts[-3].isdigit() and parts[-2] in self.expert_params_mapping:
                loaded.add(self._load_expert_tensor(original, parts, tensor, params, modules))
                continue
            if len(parts) >= 2 and parts[-2] in self.packed_modules_mapping:
                fused, shard_id = self.packed_modules_mapping[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {original!r} does not match any parameter of "
                                 f"{self.arch.architecture} (is the config right for these weights?)")
            module = modules[target.rsplit(".", 1)[0]]
            try:
                module.load_shard(param, tensor, shard_id)  # every layer with weights has one
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {original!r}: {e}") from None
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        self._check_complete(loaded, params, modules, tied)
        return loaded

    def _load_expert_tensor(self, original: str, parts: list[str], tensor: torch.Tensor,
                            params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> str:
        """Load `<prefix>.<expert>.<projection>.<suffix>` into expert `expert`'s slice of the stacked
        parameter `expert_params_mapping` names; returns its key in the loaded set."""
        stacked, shard_id = self.expert_params_mapping[parts[-2]]
        module_name, expert_id = ".".join(parts[:-3]), int(parts[-3])
        target = f"{module_name}.{stacked}"
        param, module = params.get(target), modules.get(module_name)
        if param is None or parts[-1] != "weight" or not hasattr(module, "load_expert_shard"):
            raise ValueError(f"checkpoint tensor {original!r} does not match any expert parameter of "
                             f"{self.arch.architecture} (is the config right for these weights?)")
        try:
            module.load_expert_shard(param, tensor, expert_id, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {original!r}: {e}") from None
        return _expert_key(target, expert_id, shard_id)

    def _missing_expert_tensors(self, name: str, module: nn.Module, loaded: set[str]) -> list[str]:
        """The per-expert tensors (in this model's names) of stacked parameter `name` not loaded."""
        module_name, stacked = name.rsplit(".", 1)
        projections = {v: k for k, v in self.expert_params_mapping.items()}
        num_shards = module.shards_of(stacked)
        shards = [None] if num_shards == 1 else list(range(num_shards))
        return [f"{module_name}.{e}.{projections.get((stacked, s), stacked)}.weight"
                for e in range(module.num_experts) for s in shards if _expert_key(name, e, s) not in loaded]

    def _check_complete(self, loaded: set[str], params: dict[str, nn.Parameter],
                        modules: dict[str, nn.Module], tied: bool) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and tied:
                continue
            module = modules[name.rsplit(".", 1)[0]]
            if isinstance(module, MergedLinear) and name not in loaded:
                missing += [f"{name}#{i}" for i in range(len(module.output_sizes)) if f"{name}#{i}" not in loaded]
            elif hasattr(module, "load_expert_shard") and name not in loaded:  # stacked experts
                missing += self._missing_expert_tensors(name, module, loaded)
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


def _expert_key(stacked: str, expert_id: int, shard_id: int | None) -> str:
    return f"{stacked}#expert{expert_id}" + ("" if shard_id is None else f"#{shard_id}")
