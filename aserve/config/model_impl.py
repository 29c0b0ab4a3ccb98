"""`--model-impl` (vLLM's name): which implementation builds the model, and what the Transformers
backend (`aserve/model/models/transformers_backend.py`) needs from config.json.

`auto` picks aserve's native class when the architecture has one, else the Transformers backend;
`aserve` allows only native classes; `transformers` always uses the backend. The backend serves
decoder-only causal LMs whose attention transformers routes through its `AttentionInterface`: a
config it cannot serve faithfully (encoder-decoder, not a causal LM, multimodal, ALiBi, recurrent or
state-space layers) is refused here, naming the reason, before any weights are read; what only a
built model shows (attention outside the interface, per-layer shapes) the model layer checks at load.

Families spell the sizes the runner needs differently (GPT-NeoX: `num_hidden_layers`,
`num_attention_heads`, `hidden_size`, `rotary_pct`; GPT-2: `n_layer`, `n_head`, `n_embd`; Falcon:
`multi_query`), so `transformers_arch_config` reads them through the aliases transformers' config
classes map (`attribute_map`), KV heads defaulting to the attention heads; the model layer checks the
result against transformers' own config object and the built layers. Standard library only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from aserve.config.compilation import CompilationConfig, parse_compilation_config
from aserve.config.errors import ConfigError, require
from aserve.config.hf_config import REFUSAL_REASONS, SUPPORTED_ARCHITECTURES, ArchConfig, architecture_of

if TYPE_CHECKING:
    from aserve.config.engine_args import EngineArgs

logger = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "aserve", "transformers")

# The common key ArchConfig reads -> the spellings families use for it, in order of preference.
_KEY_SPELLINGS: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "model_dim", "dim"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads",
                            "multi_query_group_num"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length",
                                "seq_length", "n_ctx"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
}
_REQUIRED = ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size")
# Layer kinds the backend serves (`layer_types`); anything else (mamba, linear_attention, conv, ...)
# is a recurrent or state-space layer.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
# Keys only recurrent / state-space / hybrid configs carry.
_RECURRENT_KEYS = ("ssm_cfg", "mamba_d_state", "mamba_d_conv", "mamba_expand", "attn_layer_period",
                   "attn_layer_indices", "hybrid_override_pattern", "layers_block_type", "block_types",
                   "linear_num_value_heads", "lru_width", "state_size", "time_step_rank")
# model_type values that always use ALiBi position biases.
_ALIBI_MODEL_TYPES = ("bloom",)
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def choose_model_impl(requested: str, architecture: str, cfg: dict[str, Any]) -> str:
    """The implementation ("aserve" | "transformers") `--model-impl requested` gives this config; logs
    which. ConfigError naming the architecture when neither may serve it."""
    native = architecture in SUPPORTED_ARCHITECTURES
    unsupported = (f"architecture {architecture!r} is not supported{REFUSAL_REASONS.get(architecture, '')}; "
                   f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    if requested == "aserve":
        require(native, "model", unsupported)
        return "aserve"
    if requested == "auto" and native:
        logger.info("--model-impl auto: %s runs on aserve's native implementation", architecture)
        return "aserve"
    reason = transformers_refusal(cfg, architecture)
    if requested == "auto":
        require(reason is None, "model", f"{unsupported}; the Transformers backend cannot serve it either: {reason}")
        logger.info("--model-impl auto: aserve has no native %s; using the Transformers backend "
                    "(transformers' modeling code with aserve's paged attention)", architecture)
    else:
        require(reason is None, "model_impl", f"the Transformers backend cannot serve {architecture!r}: {reason}")
        logger.info("--model-impl transformers: %s runs on the Transformers backend", architecture)
    return "transformers"


def transformers_refusal(cfg: dict[str, Any], architecture: str) -> str | None:
    """Why the Transformers backend cannot serve this config.json faithfully, or None."""
    seq2seq_name = architecture.endswith(("ForConditionalGeneration", "ForSeq2SeqLM"))
    if cfg.get("is_encoder_decoder") or (seq2seq_name and not _is_multimodal(cfg)):
        return "encoder-decoder models are not served (aserve runs decoder-only causal LMs)"
    if _is_multimodal(cfg):
        return "multimodal models are not served (text-only causal LMs only)"
    if not architecture.endswith(_CAUSAL_SUFFIXES) or cfg.get("is_causal") is False:
        return (f"{architecture} is not a causal language model (the backend serves *ForCausalLM / "
                "*LMHeadModel classes with causal attention)")
    attn_config = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    if (cfg.get("alibi") or attn_config.get("alibi") or cfg.get("position_embedding_type") == "alibi"
            or cfg.get("model_type") in _ALIBI_MODEL_TYPES):
        return "ALiBi position biases are not implemented by aserve's paged attention"
    if cfg.get("quantization_config") is not None:
        return "pre-quantized checkpoints (quantization_config) are not served; use a float checkpoint"
    layer_types = cfg.get("layer_types") or ()
    other = sorted({str(t) for t in layer_types if t not in _ATTENTION_LAYER_TYPES})
    recurrent_keys = [k for k in _RECURRENT_KEYS if cfg.get(k) is not None]
    if other or recurrent_keys:
        what = f"layer_types {other}" if other else f"config keys {recurrent_keys}"
        return f"recurrent / state-space layers ({what}) are not served: only attention layers use the paged KV cache"
    return None


def _is_multimodal(cfg: dict[str, Any]) -> bool:
    return any(cfg.get(k) is not None for k in ("vision_config", "audio_config", "text_config", "image_token_id",
                                                "image_token_index", "vision_tower"))


def transformers_arch_config(cfg: dict[str, Any]) -> ArchConfig:
    """`ArchConfig` for a model the Transformers backend serves: the sizes the runner needs (layers,
    KV heads, head_dim, vocab, context, EOS) read through each family's spelling. ConfigError naming
    the missing key."""
    common = dict(cfg)
    for key, spellings in _KEY_SPELLINGS.items():
        value = next((cfg[s] for s in spellings if cfg.get(s) is not None), None)
        if value is not None:
            common[key] = value
    for key in _REQUIRED:
        if common.get(key) is None:
            names = ", ".join(_KEY_SPELLINGS.get(key, (key,)))
            raise ConfigError(f"--model: config.json has no {key} (looked for {names})")
    if common.get("num_key_value_heads") is None and cfg.get("multi_query"):
        common["num_key_value_heads"] = 1  # Falcon / GPTBigCode multi-query attention
    common = {k: v for k, v in common.items() if v is not None}  # an explicit null reads as absent
    common.setdefault("intermediate_size", 0)  # not needed: transformers builds the MLP
    heads, hidden = int(common["num_attention_heads"]), int(common["hidden_size"])
    if not common.get("head_dim") and hidden % heads:
        raise ConfigError(f"--model: config.json's hidden size {hidden} is not a multiple of its {heads} "
                          "attention heads, and it gives no head_dim")
    # Parsed as a family-neutral config: a native family's parser (which refuses what aserve's own class
    # lacks) does not apply to transformers' implementation of it, and each layer's attention window
    # comes from transformers at run time (ArchConfig's windows stay None).
    neutral = ArchConfig.from_hf_dict({**common, "architectures": ["TransformersBackendModel"]})
    return dataclasses.replace(neutral, architecture=architecture_of(cfg))


def check_transformers_args(args: EngineArgs) -> None:
    """Engine arguments the Transformers backend does not implement; ConfigError naming the flag."""
    require(args.quantization is None, "quantization", "not implemented with the Transformers backend "
            "(--model-impl transformers); it serves the checkpoint's float weights")
    require(args.tensor_parallel_size == 1, "tensor_parallel_size", "not implemented with the Transformers "
            "backend (--model-impl transformers): transformers' own layers cannot be split across ranks; use an "
            "architecture aserve implements natively")
    require(args.pipeline_parallel_size == 1, "pipeline_parallel_size", "not implemented with the Transformers "
            "backend (--model-impl transformers): transformers' own model is not split into stages")
    require(not args.disable_sliding_window, "disable_sliding_window",
            "not implemented with the Transformers backend: each layer uses the window transformers passes")
    level = parse_compilation_config(args.compilation_config).get("level", 0)
    require(level == 0, "compilation_config", "-O3 (CUDA graphs / a compiled decode) is not implemented with "
            "the Transformers backend, which runs eagerly; drop -O3 or use an architecture aserve implements")


def eager_for_transformers(compilation: CompilationConfig, device: str) -> CompilationConfig:
    """The Transformers backend runs eagerly: the CUDA default (-O3, CUDA graphs) falls back to eager
    with a log line (an explicit -O3 was refused by `check_transformers_args`)."""
    if compilation.level != 0 and device == "cuda":
        logger.info("Transformers backend: no CUDA graphs; decode runs eagerly")
    return CompilationConfig(level=0)
