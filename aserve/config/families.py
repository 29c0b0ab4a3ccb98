"""Per-family config.json fields, parsed in one place into small typed structs.

`ArchConfig` holds what every decoder has (sizes, heads, RoPE, norms' epsilon, windows); what only
some families have lives in a frozen struct per family, in `ArchConfig.family`, built here by the
parser registered for the architecture (`FAMILY_PARSERS`). Families whose config.json spells the
common fields differently (GPT-2's `n_embd`, OPT's `ffn_dim`) are renamed to the common spelling by
`normalize_keys` before anything reads them. A field this engine cannot honour raises ConfigError
naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError

# Architecture -> {its config.json key: the common key ArchConfig reads}.
KEY_ALIASES: dict[str, dict[str, str]] = {}
# Architecture -> {config.json key: the value its transformers config class gives when the file lacks it},
# for keys the common fields read where that default differs from the generic one.
KEY_DEFAULTS: dict[str, dict[str, Any]] = {}
# Architecture -> {RoPE type as its config.json may spell it: the type transformers reads it as}.
ROPE_TYPE_ALIASES: dict[str, dict[str, str]] = {}
# Architecture -> function of the renamed config giving common keys that family's modeling code derives
# instead of reading (GPT-2's MLP width `n_inner or 4 * n_embd`; no grouped-query heads): they replace
# whatever config.json holds under those names.
DERIVED_KEYS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def normalize_keys(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the architecture's own spellings of the common keys renamed (the common spelling
    wins when both are present), its class defaults (`KEY_DEFAULTS`) filled in and its derived keys
    (`DERIVED_KEYS`) set."""
    aliases = KEY_ALIASES.get(architecture) or {}
    defaults = KEY_DEFAULTS.get(architecture) or {}
    derive = DERIVED_KEYS.get(architecture)
    if not aliases and not defaults and derive is None:
        return cfg
    out = {**defaults, **cfg}
    for own, common in aliases.items():
        if own in cfg and common not in cfg:
            out[common] = cfg[own]
    if derive is not None:
        out.update(derive(out))
    return out


def require_key(cfg: dict[str, Any], key: str, allowed: Callable[[Any], bool], what: str) -> None:
    """ConfigError naming `key` unless `allowed(cfg.get(key))`."""
    if not allowed(cfg.get(key)):
        raise ConfigError(f"--model: config.json's {key}={cfg.get(key)!r}: {what}")


# Architecture -> parser of its family struct (None: the family has no extra fields).
FAMILY_PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {}


def parse_family_fields(architecture: str, cfg: dict[str, Any]) -> Any:
    """The family struct for `architecture` (None when it has no extra fields)."""
    parser = FAMILY_PARSERS.get(architecture)
    return None if parser is None else parser(cfg)



@dataclass(frozen=True)
class GemmaFields:
    """Gemma 2 / Gemma 3 text."""

    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None  # Gemma 2: scores capped as cap * tanh(s / cap)
    final_logit_softcap: float | None  # Gemma 2: logits capped likewise
    qk_norm: bool  # Gemma 3: (1 + w) RMSNorm over each head of q and k
    local_rope_theta: float | None  # Gemma 3: the sliding layers' RoPE base (None: as the global layers)


def _gemma_fields(cfg: dict[str, Any], gemma3: bool) -> GemmaFields:
    local_theta = None
    if gemma3:
        per_type = cfg.get("rope_parameters") or {}
        local = per_type.get("sliding_attention") if "sliding_attention" in per_type else None
        if local is not None:
            require_key({"rope_parameters.sliding_attention": local.get("rope_type", "default")},
                        "rope_parameters.sliding_attention", lambda kind: kind == "default",
                        "only plain RoPE is implemented for Gemma 3's sliding layers")
            local_theta = float(local.get("rope_theta", 10000.0))
        else:
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return GemmaFields(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
        final_logit_softcap=float(final_cap) if final_cap else None,
        qk_norm=gemma3,
        local_rope_theta=local_theta,
    )


KEY_ALIASES["Gemma2ForCausalLM"] = KEY_ALIASES["Gemma3ForCausalLM"] = {"hidden_activation": "hidden_act"}
FAMILY_PARSERS["Gemma2ForCausalLM"] = lambda cfg: _gemma_fields(cfg, gemma3=False)
FAMILY_PARSERS["Gemma3ForCausalLM"] = lambda cfg: _gemma_fields(cfg, gemma3=True)


@dataclass(frozen=True)
class Phi3Fields:
    """Phi-3 (and Phi-4-mini, which shares the architecture)."""

    partial_rotary_factor: float  # the rotary turns the first int(head_dim * factor) dims of each head

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def _phi3_fields(cfg: dict[str, Any]) -> Phi3Fields:
    # transformers' Phi3Config: the RoPE dict's own factor, else the top-level key, else 1.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = 1.0 if factor is None else float(factor)
    require_key({"partial_rotary_factor": factor}, "partial_rotary_factor", lambda f: 0 < f <= 1,
                "must be in (0, 1]")
    return Phi3Fields(partial_rotary_factor=factor)


FAMILY_PARSERS["Phi3ForCausalLM"] = _phi3_fields
# Phi3Config's class default, which transformers prefers to the RoPE dict's own value.
KEY_DEFAULTS["Phi3ForCausalLM"] = {"original_max_position_embeddings": 4096}
ROPE_TYPE_ALIASES["Phi3ForCausalLM"] = {"su": "longrope", "yarn": "longrope"}  # Phi3Config's old names


# GPT-2 and OPT: the non-gated MLP activations implemented (aserve/model/layers/activation.py `get_act_fn`).
NON_GATED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _require_activation(cfg: dict[str, Any], default: str) -> str:
    act = cfg.get("activation_function") or default
    require_key({"activation_function": act}, "activation_function", lambda a: a in NON_GATED_ACTIVATIONS,
                f"not implemented (supported: {', '.join(NON_GATED_ACTIVATIONS)})")
    return act


def _multi_head(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 and OPT read neither num_key_value_heads nor head_dim: every head has its own K/V and
    head_dim = hidden_size / num_attention_heads."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise ConfigError(f"--model: config.json's hidden size {hidden} is not a multiple of its "
                          f"{heads} attention heads")
    return {"num_key_value_heads": heads, "head_dim": hidden // heads}


@dataclass(frozen=True)
class GPT2Fields:
    """GPT-2 (`GPT2LMHeadModel`)."""

    layer_norm_epsilon: float
    activation_function: str  # the MLP's (non-gated) activation
    scale_attn_weights: bool  # False: attention scores are not scaled by head_dim ** -0.5
    scale_attn_by_inverse_layer_idx: bool  # layer i's scores also scaled by 1 / (i + 1)


def _gpt2_fields(cfg: dict[str, Any]) -> GPT2Fields:
    for key in ("reorder_and_upcast_attn", "add_cross_attention"):
        require_key(cfg, key, lambda v: not v, "not implemented")
    return GPT2Fields(
        layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        activation_function=_require_activation(cfg, "gelu_new"),
        scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
    )


def _gpt2_derived(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("n_inner")  # None: 4 * n_embd (GPT2Block); a stray intermediate_size is ignored
    return {**_multi_head(cfg), "intermediate_size": int(inner) if inner is not None else 4 * int(cfg["hidden_size"])}


@dataclass(frozen=True)
class OPTFields:
    """OPT (`OPTForCausalLM`); its LayerNorms use transformers' fixed eps 1e-5."""

    word_embed_proj_dim: int  # the embedding's width; != hidden_size: project_in / project_out layers
    do_layer_norm_before: bool  # True: pre-LN (opt-125m and most sizes); False: post-LN (opt-350m)
    enable_bias: bool  # biases on q/k/v/out_proj and fc1/fc2
    layer_norm_elementwise_affine: bool  # False: LayerNorms without weight and bias
    activation_function: str


def _opt_fields(cfg: dict[str, Any]) -> OPTFields:
    require_key(cfg, "_remove_final_layer_norm", lambda v: not v, "not implemented")
    return OPTFields(
        word_embed_proj_dim=int(cfg.get("word_embed_proj_dim") or cfg["hidden_size"]),
        do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
        enable_bias=bool(cfg.get("enable_bias", True)),
        layer_norm_elementwise_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
        activation_function=_require_activation(cfg, "relu"),
    )


KEY_ALIASES["GPT2LMHeadModel"] = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
                                  "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
                                  "n_inner": "intermediate_size"}
KEY_ALIASES["OPTForCausalLM"] = {"ffn_dim": "intermediate_size"}
KEY_DEFAULTS["GPT2LMHeadModel"] = {"tie_word_embeddings": True, "max_position_embeddings": 1024}
KEY_DEFAULTS["OPTForCausalLM"] = {"tie_word_embeddings": True}
DERIVED_KEYS["GPT2LMHeadModel"] = _gpt2_derived
DERIVED_KEYS["OPTForCausalLM"] = _multi_head
FAMILY_PARSERS["GPT2LMHeadModel"] = _gpt2_fields
FAMILY_PARSERS["OPTForCausalLM"] = _opt_fields


@dataclass(frozen=True)
class MoeFields:
    """Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): which layers are sparse and how
    tokens are routed. Routing is softmax over the router's logits, the top `num_experts_per_tok`
    kept, renormalized to sum 1 when `norm_topk_prob` (Mixtral always)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert's MLP width (Mixtral: intermediate_size)
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert (0: none), gated by sigmoid
    norm_topk_prob: bool
    decoder_sparse_step: int  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...]  # ... and i is not listed here (those use the dense MLP)

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` uses the routed experts (else the dense MLP of `intermediate_size`)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


# Routing options of other MoE families (DeepSeek, GLM, Llama 4 ...) that change which experts a token
# gets or how their outputs are weighted; this engine implements none of them, so a config setting one
# to anything but its neutral value is refused rather than served wrong. (`output_router_logits`,
# `router_aux_loss_coef` and `router_jitter_noise` only matter in training and are ignored.)
_NEUTRAL_ROUTER_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "scoring_func": lambda v: v in (None, "softmax"),
    "topk_method": lambda v: v in (None, "greedy"),
    "routed_scaling_factor": lambda v: v in (None, 1, 1.0),
    "n_group": lambda v: v in (None, 1),
    "topk_group": lambda v: v in (None, 1),
    "n_shared_experts": lambda v: not v,
    "moe_layer_freq": lambda v: v in (None, 1),
}


# transformers' class defaults for keys a config.json may lack.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632},
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}


def _moe_fields(cfg: dict[str, Any], architecture: str) -> MoeFields:
    """Mixtral: every layer sparse, experts `intermediate_size` wide, top-k renormalized, no shared
    expert. Qwen2-MoE: as its config says, with a shared expert. Qwen3-MoE: as Qwen2-MoE without one."""
    for key, neutral in _NEUTRAL_ROUTER_OPTIONS.items():
        require_key(cfg, key, neutral, "this MoE routing option is not implemented")
    require_key(cfg, "hidden_act", lambda a: a in (None, "silu", "swish"), "MoE experts implement SiLU only")
    mixtral = architecture == "MixtralForCausalLM"
    # The config classes map num_experts <-> num_local_experts (transformers writes either).
    names = ("num_local_experts", "num_experts") if mixtral else ("num_experts", "num_local_experts")
    given = [cfg[name] for name in names if cfg.get(name) is not None]
    cfg = {**_MOE_DEFAULTS[architecture], **cfg}
    num_experts = int(given[0] if given else cfg[names[0]])
    top_k = int(cfg["num_experts_per_tok"])
    require_key(cfg, "num_experts_per_tok", lambda k: num_experts == 0 or 1 <= int(k) <= num_experts,
                f"must be between 1 and the number of experts ({num_experts})")
    step = 1 if mixtral else int(cfg.get("decoder_sparse_step") or 1)
    require_key({"decoder_sparse_step": step}, "decoder_sparse_step", lambda s: s >= 1, "must be >= 1")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return MoeFields(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=() if mixtral else tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def _mixtral_derived(cfg: dict[str, Any]) -> dict[str, Any]:
    """MixtralConfig: no attention biases; RoPE base 1e6 when config.json gives none."""
    out: dict[str, Any] = {"attention_bias": False}
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        out["rope_theta"] = 1e6
    return out


FAMILY_PARSERS["MixtralForCausalLM"] = lambda cfg: _moe_fields(cfg, "MixtralForCausalLM")
FAMILY_PARSERS["Qwen2MoeForCausalLM"] = lambda cfg: _moe_fields(cfg, "Qwen2MoeForCausalLM")
FAMILY_PARSERS["Qwen3MoeForCausalLM"] = lambda cfg: _moe_fields(cfg, "Qwen3MoeForCausalLM")
DERIVED_KEYS["MixtralForCausalLM"] = _mixtral_derived
# Qwen2-MoE's q/k/v bias is `qkv_bias` (default True; o_proj never has one); it reads no attention_bias.
DERIVED_KEYS["Qwen2MoeForCausalLM"] = lambda cfg: {"attention_bias": bool(cfg.get("qkv_bias", True))}


# -- Encoders (issue 23: pooling models) ---------------------------------------------------------

@dataclass(frozen=True)
class BertFields:
    """BERT encoders (`BertModel`, `BertForSequenceClassification`): post-norm blocks, learned absolute
    positions, token-type embeddings."""

    layer_norm_eps: float
    type_vocab_size: int  # rows of the token-type table (0: none)
    pad_token_id: int | None
    num_labels: int  # the classifier's outputs (ForSequenceClassification)
    id2label: tuple[str, ...]  # label names by index ("LABEL_i" where config.json names none)


def _bert_fields(cfg: dict[str, Any]) -> BertFields:
    require_key(cfg, "position_embedding_type", lambda v: v in (None, "absolute"),
                "only absolute position embeddings are implemented")
    require_key(cfg, "is_decoder", lambda v: not v, "a BERT decoder is not implemented")
    require_key(cfg, "add_cross_attention", lambda v: not v, "not implemented")
    require_key(cfg, "hidden_act", lambda a: a in (None, *NON_GATED_ACTIVATIONS),
                f"not implemented (supported: {', '.join(NON_GATED_ACTIVATIONS)})")
    id2label = cfg.get("id2label") or {}
    num_labels = int(cfg.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    return BertFields(
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        pad_token_id=cfg.get("pad_token_id", 0),
        num_labels=num_labels,
        id2label=labels,
    )


for _bert in ("BertModel", "BertForSequenceClassification"):
    FAMILY_PARSERS[_bert] = _bert_fields
    # BertConfig's class defaults where the common fields' generic ones differ; BERT has every bias.
    KEY_DEFAULTS[_bert] = {"hidden_act": "gelu", "max_position_embeddings": 512}
    DERIVED_KEYS[_bert] = lambda cfg: {"attention_bias": True, "num_key_value_heads": int(cfg["num_attention_heads"]),
                                       "tie_word_embeddings": False}
