"""A Hugging Face config.json read into `ArchConfig`: the architecture the model files build.

Covers both spellings transformers has used (`rope_parameters` in transformers 5, `rope_theta` /
`rope_scaling` before), per-family defaults (Qwen2's q/k/v bias, Mistral's sliding window), and the
context length the checkpoint supports, and each layer's attention window. A config this engine
cannot serve faithfully raises `ConfigError` naming the key, at start-up rather than as wrong
outputs later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config.errors import ConfigError
from aserve.config.families import ROPE_TYPE_ALIASES, normalize_keys, parse_family_fields

# The architectures aserve/model/models/registry.py implements (it checks that the lists agree); kept
# here as plain strings so a config is rejected before any torch import or model download.
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                     "Qwen3ForCausalLM", "Gemma2ForCausalLM",
                                     "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel",
                                     "OPTForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                     "Qwen3MoeForCausalLM"})

# Encoder-only pooling architectures (issue 23; aserve/model/models/bert.py): bidirectional attention,
# no KV cache, no LM head. Kept apart from SUPPORTED_ARCHITECTURES (the generating ones), so the
# generate path never admits them; aserve/model/models/registry.py checks POOLING_MODEL_CLASSES against it.
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})

# Architectures refused with a reason beyond "no model class" (appended to the refusal).
REFUSAL_REASONS = {
    "Gemma3ForConditionalGeneration": " (the image-text Gemma 3; aserve serves text-only checkpoints: "
                                      "Gemma3ForCausalLM, e.g. google/gemma-3-1b-it)",
}

# transformers' Qwen2/Qwen3 default: layers with index >= max_window_layers use the sliding window.
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
_QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Gemma's sliding/global alternation when config.json has no layer_types: every pattern-th layer is global.
_GEMMA_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
# Families whose attention honours `sliding_window`, with the default of their `use_sliding_window`
# switch; transformers' Llama ignores the key, and so do we.
_USE_SLIDING_WINDOW_DEFAULT = {"MistralForCausalLM": True, "Qwen2ForCausalLM": False, "Qwen3ForCausalLM": False,
                               "Gemma2ForCausalLM": True, "Gemma3ForCausalLM": True,
                               "Phi3ForCausalLM": True,  # Phi3: every layer, no switch key
                               "MixtralForCausalLM": True, "Qwen2MoeForCausalLM": False,
                               "Qwen3MoeForCausalLM": False}
# Families whose window, when on, applies to every layer whatever layer_types says (their config
# classes read no layer_types): Mixtral as Mistral, Qwen3-MoE.
_WINDOW_ON_EVERY_LAYER = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ArchConfig:
    """The model's architecture, read from its config.json (plus overrides).

    `layer_sliding_windows` holds each layer's attention window (None: full attention); layers of
    one model may differ (Qwen2's `max_window_layers`, `layer_types`). `family` is the frozen struct
    of the fields only this architecture's family has (`aserve.config.families`), or None.
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
    layer_sliding_windows: tuple[int | None, ...] = ()
    family: Any = None
    # A pipeline stage's view (config/parallel.py `stage_arch_config`): this model holds checkpoint layers
    # first_layer .. first_layer + num_hidden_layers - 1; per-layer fields stay indexed by global layer.
    first_layer: int = 0
    total_layers: int = 0  # a stage's model: the checkpoint's layer count (0: the whole model, not a stage)

    @property
    def is_encoder(self) -> bool:
        """An encoder-only pooling architecture (`ENCODER_ARCHITECTURES`): bidirectional, no KV cache,
        serves embeddings / scores only (its default pooling: aserve/config/pooler.py)."""
        return self.architecture in ENCODER_ARCHITECTURES

    def sliding_window_of(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: full attention)."""
        return self.layer_sliding_windows[layer] if self.layer_sliding_windows else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], hf_overrides: dict[str, Any] | None = None, *,
                     disable_sliding_window: bool = False) -> ArchConfig:
        """Parse config.json's dict (`hf_overrides` merged on top); `disable_sliding_window` gives
        every layer full attention."""
        cfg = {**cfg, **(hf_overrides or {})}
        arch = architecture_of(cfg)
        cfg = normalize_keys(arch, cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope(cfg, arch)
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
            layer_sliding_windows=() if disable_sliding_window else tuple(layer_sliding_windows(cfg, arch)),
            family=parse_family_fields(arch, cfg),
        )


def architecture_of(cfg: dict[str, Any]) -> str:
    """config.json's `architectures[0]` (Llama when absent, as older checkpoints were)."""
    return (cfg.get("architectures") or ["LlamaForCausalLM"])[0]


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

    A window applies only to the families that honour it, if `sliding_window` is set and
    `use_sliding_window` allows it (default True for Mistral, False for Qwen2/Qwen3). `layer_types`
    ("sliding_attention" / "full_attention" per layer) decides which layers use it where present;
    otherwise Qwen2/Qwen3 apply it to layers with index >= `max_window_layers` (default 28) and
    Mistral to every layer.
    """
    n = int(cfg["num_hidden_layers"])
    switch_default = _USE_SLIDING_WINDOW_DEFAULT.get(architecture)
    window = cfg.get("sliding_window") if switch_default is not None else None
    if not cfg.get("use_sliding_window", switch_default):
        window = None
    if not window:
        return [None] * n
    layer_types = cfg.get("layer_types") if architecture not in _WINDOW_ON_EVERY_LAYER else None
    if layer_types is None and architecture == "Qwen2MoeForCausalLM":  # Qwen2MoeConfig: even layers below the cut
        first = int(cfg.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = ["sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(n)]
    if layer_types is None and architecture in _QWEN_ARCHITECTURES:
        first = int(cfg.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if layer_types is None and architecture in _GEMMA_PATTERNS:  # configs older than transformers 5
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or _GEMMA_PATTERNS[architecture])
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if layer_types is None:
        return [int(window)] * n
    if len(layer_types) != n:
        raise ConfigError(f"--model: config.json's layer_types has {len(layer_types)} entries for "
                          f"num_hidden_layers={n}")
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def _rope(cfg: dict[str, Any], architecture: str = "") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling with a `rope_type` key, or None for plain RoPE) from either spelling.

    As transformers' `standardize_rope_params`: the architecture's old type names are read as the
    current ones (`ROPE_TYPE_ALIASES`), and for llama3 / yarn / longrope a top-level
    `original_max_position_embeddings` (where Phi-3 keeps it) wins over the RoPE dict's own."""
    # transformers 5 writes rope_parameters; older configs have rope_theta / rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    if "full_attention" in rope_params:  # per layer type (Gemma 3): the global layers' are the model's
        rope_params = rope_params["full_attention"] or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params:
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        kind = ROPE_TYPE_ALIASES.get(architecture, {}).get(kind, kind)
        rope_scaling["rope_type"] = kind
        if kind in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
            rope_scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        if kind == "default":
            rope_scaling = None
    return float(rope_theta), rope_scaling


def derived_max_model_len(arch: ArchConfig) -> int:
    """The longest context the checkpoint supports: max_position_embeddings, times the RoPE scaling
    factor for linear, dynamic and yarn scaling (llama3 and longrope scaling keep the declared length:
    a longrope config's max_position_embeddings already is the extended context, its
    original_max_position_embeddings the pre-training one)."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "dynamic", "yarn") and "factor" in scaling:
        return int(arch.max_position_embeddings * float(scaling["factor"]))
    return arch.max_position_embeddings
