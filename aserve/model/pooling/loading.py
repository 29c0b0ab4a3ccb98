"""Building a pooling model from a local Hugging Face folder, outside the engine's `load_model`
(which serves the generating architectures): the encoder's class (or a causal family's decoder
embedder), its checkpoint loaded, the CPU Linear forms chosen, and its resolved pooler."""

from __future__ import annotations

import torch
from torch import nn

from aserve.config.hf_config import ArchConfig, read_hf_config
from aserve.model.loader import init_dummy_weights, iterate_weights
from aserve.model.models.registry import get_pooling_model_class
from aserve.config.pooler import PoolerConfig, resolve_pooler_config
from aserve.model.pooling.pooler import ClassifierPooler, Pooler, build_pooler
from aserve.model.quantization import assign


def load_pooling_model(model_path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                       backend: object = None, load_format: str = "auto", seed: int = 0,
                       arch: ArchConfig | None = None) -> nn.Module:
    """The folder's model for pooling, weights loaded, in eval mode. `backend`: the paged attention
    backend a causal embedder needs (an encoder uses its own). `arch`: the resolved architecture
    (default: the folder's config.json). Raises ValueError when the architecture cannot pool or the
    checkpoint does not fit it."""
    arch = arch or ArchConfig.from_hf_dict(read_hf_config(model_path))
    model_cls = get_pooling_model_class(arch.architecture)
    model = model_cls(arch, backend, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iterate_weights(model_path, load_format))
    assign.use_cpu_linear_forms(model)
    assign.process_weights_after_loading(model)
    return model.eval()


def pooler_for(model: nn.Module, model_path: str | None, task: str = "embed",
               override: str | dict | PoolerConfig | None = None) -> Pooler | ClassifierPooler:
    """The resolved pooler of `model` loaded from `model_path` (`resolve_pooler_config`); with task
    `embed` a classifier model gives its pooled hidden state, not its logits."""
    config = resolve_pooler_config(model_path, model.arch.architecture, task, override)
    if task == "embed":
        return Pooler(config)
    return build_pooler(model, config)
