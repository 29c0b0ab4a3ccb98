"""Reading a PEFT LoRA adapter folder into the model's terms.

`load_peft_adapter(path, model, lora_config)` reads `adapter_config.json` and `adapter_model.safetensors`
(or `adapter_model.bin`), maps every `<module>.lora_A.weight [r, in]` / `.lora_B.weight [out, r]` /
`.lora_B.bias [out]` (PEFT's names, `base_model.model.` prefix dropped) onto the model's Linear layers
through `model.checkpoint_name` and `model.packed_modules_mapping` (`q_proj` -> shard 0 of `qkv_proj`),
folds the scaling into B and the bias (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`;
`rank_pattern` / `alpha_pattern` per module, as PEFT matches them) and casts to `lora_config.lora_dtype`
on the host. Tensors stay checkpoint-sized: `set_slot` takes each rank's part under tensor parallelism.
A whole-layer adapter on a fused layer (GPT-2's `c_attn`) is split into the layer's shards.

Everything not served is refused with `LoRAAdapterError` naming the problem: a missing folder or file,
a rank above `max_lora_rank`, a target the model lacks or that is not a Linear (embed_tokens, lm_head),
`modules_to_save`, DoRA, adapters that add tokens, a LoRA bias without `enable_lora_bias`, bad shapes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aserve.config import LoRAConfig
from aserve.lora.errors import LoRAAdapterError
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.lora.layers import LORA_DTYPES, LoRAShardWeights, full_input_size, full_output_sizes

_PEFT_PREFIX = "base_model.model."
# <module>.lora_A.weight | <module>.lora_B.weight | <module>.lora_B.bias (an adapter name may precede the leaf)
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.(?P<leaf>weight|bias)$")
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "wpe", "embed_positions", "embed_in", "embed_out")
_ADDED_TOKEN_FILES = ("new_embeddings.safetensors", "new_embeddings.bin", "added_tokens.json")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter in the model's terms: `modules` maps a Linear layer's name to one entry per shard
    (None: the shard is not targeted). `rank` is the largest rank of any module."""

    path: str
    rank: int
    modules: dict[str, tuple[LoRAShardWeights | None, ...]]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for shards in self.modules.values() for w in shards
                   if w is not None for t in (w.lora_a, w.lora_b, w.lora_bias) if t is not None)


def load_peft_adapter(path: str | Path, model: nn.Module, lora_config: LoRAConfig) -> LoRAAdapter:
    """The adapter at `path` for `model` (see the module docstring); raises LoRAAdapterError."""
    folder = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: no such folder")
    config = _read_config(folder, where)
    _check_config(config, folder, where, lora_config)
    tensors = _read_tensors(folder, where)
    grouped = _group_by_module(tensors, where)
    modules = dict(model.named_modules())
    dtype = LORA_DTYPES[lora_config.lora_dtype]
    out: dict[str, list[LoRAShardWeights | None]] = {}
    max_rank = 0
    for peft_module, parts in sorted(grouped.items()):
        layer_name, shard = _model_layer(model, modules, peft_module, where)
        layer = modules[layer_name]
        rank = _check_shapes(parts, layer, shard, peft_module, where, lora_config)
        if "bias" in parts and not lora_config.enable_lora_bias:
            raise LoRAAdapterError(f"{where}: {peft_module} has a LoRA bias (lora_bias); start the server with "
                                   "--enable-lora-bias to serve it")
        scaling = _scaling(config, peft_module, rank, where)
        a = parts["A"].to(dtype).contiguous()
        b = (parts["B"].float() * scaling).to(dtype)
        bias = (parts["bias"].float() * scaling).to(dtype) if "bias" in parts else None
        num_shards = len(layer.output_sizes) if isinstance(layer, MergedLinear) else 1
        entries = out.setdefault(layer_name, [None] * num_shards)
        if shard is None and num_shards > 1:  # one pair for a whole fused layer: same A, B split by part
            sizes = full_output_sizes(layer)
            b_parts = b.split(sizes, 0)
            bias_parts = bias.split(sizes, 0) if bias is not None else [None] * num_shards
            targets = [(i, LoRAShardWeights(a, bp.contiguous(), None if cp is None else cp.contiguous()))
                       for i, (bp, cp) in enumerate(zip(b_parts, bias_parts, strict=True))]
        else:
            targets = [(shard or 0, LoRAShardWeights(a, b.contiguous(), bias))]
        for i, weights in targets:
            if entries[i] is not None:
                raise LoRAAdapterError(f"{where}: {layer_name} shard {i} is targeted twice")
            entries[i] = weights
        max_rank = max(max_rank, rank)
    if not out:
        raise LoRAAdapterError(f"{where}: no LoRA tensors (lora_A / lora_B) in the adapter")
    return LoRAAdapter(str(path), max_rank, {name: tuple(ws) for name, ws in out.items()})


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoRAAdapterError(f"{where}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{where}: adapter_config.json is unreadable: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json is not a JSON object")
    return config


def _check_config(config: dict[str, Any], folder: Path, where: str, lora_config: LoRAConfig) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type} is not LoRA")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {config['modules_to_save']} is set (fully trained copies "
                               "of modules); such adapters are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(t for t in targets if isinstance(t, str) and t.rsplit(".", 1)[-1] in _EMBEDDING_NAMES)
        if bad:
            raise LoRAAdapterError(f"{where}: targets {bad}: LoRA on embeddings / the LM head is not supported "
                                   "(only Linear projections of the decoder layers)")
    if config.get("trainable_token_indices"):
        raise LoRAAdapterError(f"{where}: trainable_token_indices (trained token embeddings) is not supported")
    added = [name for name in _ADDED_TOKEN_FILES if (folder / name).exists()]
    if added:
        raise LoRAAdapterError(f"{where}: the adapter adds tokens ({', '.join(added)}); extra vocabulary is not "
                               "supported")
    if config.get("lora_bias") and not lora_config.enable_lora_bias:
        raise LoRAAdapterError(f"{where}: the adapter has a LoRA bias (lora_bias); start the server with "
                               "--enable-lora-bias to serve it")


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file), device="cpu")
        if bin_file.is_file():
            return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file of any kind is the adapter's problem
        raise LoRAAdapterError(f"{where}: cannot read the adapter weights: {e}") from None
    raise LoRAAdapterError(f"{where}: no adapter_model.safetensors or adapter_model.bin")


def _group_by_module(tensors: dict[str, torch.Tensor], where: str) -> dict[str, dict[str, torch.Tensor]]:
    """{PEFT module name (prefix dropped): {"A": [r, in], "B": [out, r], "bias": [out]}}."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        short = name.removeprefix(_PEFT_PREFIX)
        if "lora_embedding_" in short:
            raise LoRAAdapterError(f"{where}: {short}: LoRA on embeddings is not supported")
        if "lora_magnitude_vector" in short:
            raise LoRAAdapterError(f"{where}: {short}: DoRA adapters are not supported")
        match = _TENSOR_NAME.match(short)
        if match is None or (match["which"] == "A" and match["leaf"] == "bias"):
            raise LoRAAdapterError(f"{where}: unexpected tensor {name!r} (not a LoRA A/B weight or B bias)")
        key = "bias" if match["leaf"] == "bias" else match["which"]
        grouped.setdefault(match["module"], {})[key] = tensor
    for module, parts in grouped.items():
        if "A" not in parts or "B" not in parts:
            raise LoRAAdapterError(f"{where}: {module} has lora_{'B' if 'A' in parts else 'A'} missing")
    return grouped


def _model_layer(model: nn.Module, modules: dict[str, nn.Module], peft_module: str,
                 where: str) -> tuple[str, int | None]:
    """(the model's Linear layer name, shard id or None) for a PEFT module name."""
    leaf = peft_module.rsplit(".", 1)[-1]
    if leaf in _EMBEDDING_NAMES:
        raise LoRAAdapterError(f"{where}: targets {peft_module} ({leaf}): LoRA on embeddings / the LM head is not "
                               "supported (only Linear projections of the decoder layers)")
    checkpoint_name = getattr(model, "checkpoint_name", lambda n: n)
    name = checkpoint_name(f"{peft_module}.weight")
    arch = getattr(getattr(model, "arch", None), "architecture", type(model).__name__)
    if name is None:
        raise LoRAAdapterError(f"{where}: targets {peft_module}, which {arch} does not use")
    name = name.removesuffix(".weight")
    parent, _, short = name.rpartition(".")
    shard = None
    mapping: dict[str, tuple[str, int]] = getattr(model, "packed_modules_mapping", {})
    if short in mapping:
        fused, shard = mapping[short]
        name = f"{parent}.{fused}" if parent else fused
    layer = modules.get(name)
    if layer is None:
        raise LoRAAdapterError(f"{where}: targets {peft_module}, which {arch} does not have (is the adapter for "
                               "this model?)")
    if not isinstance(layer, Linear):
        raise LoRAAdapterError(f"{where}: targets {peft_module}, a {type(layer).__name__}: LoRA applies to Linear "
                               "projections only")
    return name, shard


def _check_shapes(parts: dict[str, torch.Tensor], layer: Linear, shard: int | None, module: str, where: str,
                  lora_config: LoRAConfig) -> int:
    """The module's rank, after checking its tensors fit `layer` (shard `shard`) and the rank limit."""
    a, b = parts["A"], parts["B"]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoRAAdapterError(f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
                               "[r, in] / [out, r]")
    rank = int(a.shape[0])
    if rank > lora_config.max_lora_rank:
        raise LoRAAdapterError(f"{where}: {module} has rank {rank}, above --max-lora-rank {lora_config.max_lora_rank}")
    sizes = full_output_sizes(layer)
    out = sizes[shard] if shard is not None else sum(sizes)
    if a.shape[1] != full_input_size(layer) or b.shape[0] != out:
        raise LoRAAdapterError(f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                               f"model's layer ([{rank}, {full_input_size(layer)}] / [{out}, {rank}] expected)")
    if "bias" in parts and tuple(parts["bias"].shape) != (out,):
        raise LoRAAdapterError(f"{where}: {module}: lora_B bias {tuple(parts['bias'].shape)} is not [{out}]")
    return rank


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern matching the end of the module name at a dot."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(config: dict[str, Any], module: str, rank: int, where: str) -> float:
    expected = _pattern_value(config.get("rank_pattern"), module, config.get("r", rank))
    if int(expected) != rank:
        raise LoRAAdapterError(f"{where}: {module}: lora_A has rank {rank}, adapter_config.json says {expected}")
    alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank)))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
