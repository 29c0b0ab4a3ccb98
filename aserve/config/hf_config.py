"""A Hugging Face config.json read into `ArchConfig`: the architecture the model files build.

Covers both spellings transformers has used (`rope_parameters` in transformers 5, `rope_theta` /
`rope_scaling` before), per-family defaults (Qwen2's q/k/v bias, Mistral's sliding window), and the
context length the checkpoint supports. A config this engine cannot serve faithfully (an
architecture without a model class, or sliding windows on only some layers) raises `ConfigError`
naming the key, at start-up rather than as wrong outputs later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config.errors import ConfigError

# The architectures aserve/model/models/registry.py implements (it checks that the lists agree); kept
# here as plain strings so a config is rejected before any torch import or model download.
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

# transformers' Qwen2Config default: layers with index >= max_window_layers use the sliding window.
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class ArchConfig:
    """The model's architecture, read from its config.json (plus overrides).

    `sliding_window` is the window every layer uses, or None when no layer uses one.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], hf_overrides: dict[str, Any] | None = None, *,
                     disable_sliding_window: bool = False) -> ArchConfig:
        """Parse config.json's dict (`hf_overrides` merged on top).

        Raises ConfigError naming `layer_types` / `max_window_layers` when some layers would use a
        sliding window and others not (per-layer windows are not implemented), unless
        `disable_sliding_window` drops the window from every layer.
        """
        cfg = {**cfg, **(hf_overrides or {})}
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=None if disable_sliding_window else _uniform_sliding_window(cfg, arch),
        )


def read_hf_config(model_path: str) -> dict[str, Any]:
    """The parsed config.json of the folder `model_path`; ConfigError naming --model if there is none."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"--model: no config.json in {model_path!r}")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model: {cfg_file} is not valid JSON ({exc})") from None


def layer_sliding_windows(cfg: dict[str, Any], architecture: str) -> list[int | None]:
    """Each layer's sliding window (None = full attention), with transformers' semantics.

    The window applies only if `use_sliding_window` (default True for Mistral, False otherwise) and
    `sliding_window` is set. Mistral applies it to every layer. Qwen2 applies it to the layers whose
    `layer_types` entry is "sliding_attention"; without `layer_types`, to layers with index >=
    `max_window_layers` (default 28).
    """
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", architecture == "MistralForCausalLM") else None
    if not window:
        return [None] * n
    if architecture != "Qwen2ForCausalLM":
        return [int(window)] * n
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg.get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def _uniform_sliding_window(cfg: dict[str, Any], architecture: str) -> int | None:
    windows = set(layer_sliding_windows(cfg, architecture))
    if len(windows) <= 1:
        return windows.pop() if windows else None
    if cfg.get("layer_types") is not None:
        kinds = sorted(set(cfg["layer_types"]))
        raise ConfigError(f"--model: config.json's layer_types mixes {kinds}; per-layer sliding windows are "
                          "not implemented yet (--disable-sliding-window serves it with full attention)")
    raise ConfigError(
        f"--model: config.json's max_window_layers={cfg.get('max_window_layers', _QWEN2_DEFAULT_MAX_WINDOW_LAYERS)} "
        f"< num_hidden_layers={cfg['num_hidden_layers']} with use_sliding_window: only the later layers use the "
        "sliding window, and per-layer sliding windows are not implemented yet "
        "(--disable-sliding-window serves it with full attention)")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling with a `rope_type` key, or None for plain RoPE) from either spelling."""
    # transformers 5 writes rope_parameters; older configs have rope_theta / rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params:
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope_scaling["rope_type"] = kind
        if kind == "default":
            rope_scaling = None
    return float(rope_theta), rope_scaling


def derived_max_model_len(arch: ArchConfig) -> int:
    """The longest context the checkpoint supports: max_position_embeddings, times the RoPE scaling
    factor for linear, dynamic and yarn scaling (llama3 scaling keeps the declared length)."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "dynamic", "yarn") and "factor" in scaling:
        return int(arch.max_position_embeddings * float(scaling["factor"]))
    return arch.max_position_embeddings
