"""Building the Transformers backend's model (`--model-impl transformers`): transformers' config object
(with the user's overrides) checked against the `ArchConfig` the runner sizes the KV cache from, the
`AutoModelForCausalLM` in the model dtype on the target device with aserve's attention function, its
weights, and the load-time probe (`TransformersCausalLM.probe`).

Real weights load through `from_pretrained` with that config, from the folder's safetensors (or .bin
files with `--load-format pt`), so transformers applies its own checkpoint conversions (renamed keys
such as GPT-NeoX's `embed_out` -> `lm_head`, tied embeddings); `--load-format dummy` builds the model
`from_config` with transformers' random initialisation, seeded by `--seed`.
"""

from __future__ import annotations

import logging

import torch

from aserve.config import ArchConfig, AserveConfig, ModelConfig
from aserve.model.attention.base import AttentionBackend
from aserve.model.models.transformers_backend import (
    ATTN_IMPLEMENTATION,
    TransformersCausalLM,
    UnsupportedModelError,
)

logger = logging.getLogger(__name__)


def load_transformers_model(config: AserveConfig, backend: AttentionBackend,
                            device: torch.device | str) -> TransformersCausalLM:
    """The model for `config` (whose `model.model_impl` is "transformers"), probed and ready for
    `bind_kv_caches`. Raises WeightsNotFoundError when the folder has no weights of the load format,
    ValueError when the checkpoint does not match, UnsupportedModelError (a ValueError) naming what
    the backend cannot serve."""
    from aserve.model.loader import torch_dtype

    arch = config.model.arch
    dtype = torch_dtype(config.model.dtype)
    hf_config = transformers_config(config.model)
    check_against_arch(hf_config, arch)
    hf_model = _build(hf_config, config, dtype, torch.device(device))
    model = TransformersCausalLM(hf_model.eval(), arch, backend, dtype)
    model.probe()
    windows = sorted({layer.sliding_window for layer in model.attention_layers}, key=str)
    logger.info("Transformers backend: %s (transformers' %s with aserve's paged attention; %d layers, "
                "windows %s)", arch.architecture, type(hf_model).__name__, len(model.attention_layers), windows)
    return model.eval()


def transformers_config(model_cfg: ModelConfig):
    """transformers' config object for the folder, with the user's overrides set on it (--rope-theta /
    --rope-scaling go into transformers 5's `rope_parameters`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_cfg.hf_config_path or model_cfg.model_path,
                                     trust_remote_code=model_cfg.trust_remote_code,
                                     local_files_only=True)
    for key, value in (model_cfg.hf_overrides or {}).items():
        rope = getattr(cfg, "rope_parameters", None)
        if key in ("rope_theta", "rope_scaling") and isinstance(rope, dict):
            cfg.rope_parameters = {**rope, **({"rope_theta": value} if key == "rope_theta" else value)}
        else:
            setattr(cfg, key, value)
    return cfg


def check_against_arch(hf_config, arch: ArchConfig) -> None:
    """UnsupportedModelError unless transformers' reading of config.json agrees with `arch` (read by
    aserve's standard-library parser) on what the runner and the engine use."""
    name = type(hf_config).__name__
    if getattr(hf_config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not served by the Transformers backend")
    # Keys transformers' config class may not have (KV heads under another name) are left to the probe,
    # which checks every layer's heads against `arch`.
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        value = getattr(hf_config, key, None)
        if value is not None and int(value) != getattr(arch, key):
            raise UnsupportedModelError(f"{name}: transformers reads {key}={value} from config.json, aserve read "
                                        f"{getattr(arch, key)}; cannot size the KV cache or the vocabulary")


def _build(hf_config, config: AserveConfig, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    from aserve.model.loader import weight_files

    # Built with eager attention, then switched: a model that cannot switch (it picks attention classes
    # at construction, GPT-Neo style) is refused here, one that switches only some layers by the probe.
    kwargs = dict(dtype=dtype, attn_implementation="eager", trust_remote_code=config.model.trust_remote_code)
    try:
        if config.load.load_format == "dummy":
            torch.manual_seed(config.model.seed)
            with device:
                return _use_aserve_attention(AutoModelForCausalLM.from_config(hf_config, **kwargs))
        kind, _ = weight_files(config.model.model_path, config.load.load_format)  # WeightsNotFoundError
        model, info = AutoModelForCausalLM.from_pretrained(
            config.model.model_path, config=hf_config, device_map=device, use_safetensors=kind == "safetensors",
            local_files_only=True, output_loading_info=True, **kwargs)
        _use_aserve_attention(model)
    except ValueError as exc:  # e.g. "Unrecognized configuration class ... for this kind of AutoModel"
        if "Unrecognized configuration class" in str(exc):
            raise UnsupportedModelError(f"{type(hf_config).__name__} has no causal-LM class in transformers "
                                        "(AutoModelForCausalLM); the Transformers backend serves causal LMs only") from None
        raise
    missing = sorted(info["missing_keys"]) + [str(k) for k in info.get("mismatched_keys") or ()]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing or mis-shapes {len(missing)} weight(s): {shown}")
    if info["unexpected_keys"]:
        logger.warning("Transformers backend: %d checkpoint tensor(s) unused by %s: %s", len(info["unexpected_keys"]),
                       type(model).__name__, ", ".join(sorted(info["unexpected_keys"])[:8]))
    return model


def _use_aserve_attention(model):
    """`model` switched to aserve's attention function; UnsupportedModelError if transformers cannot."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(f"{type(model).__name__}: its attention is not routed through transformers' "
                                    "AttentionInterface, so aserve's paged attention cannot replace it")
    return model
