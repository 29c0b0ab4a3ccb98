"""Speculative decoding's configuration: vLLM's `speculative_config` (a dict, or its JSON text) and the
seeds' older flags (mapped onto it in aserve/config/vllm_compat.py), validated and resolved into the
frozen `SpeculativeConfig` (`AserveConfig.speculative`; None: speculation off).

Methods: `ngram` (prompt lookup over the prompt and the output so far, on the host) and `draft_model`
(a smaller causal LM sharing the target's vocabulary). EAGLE, Medusa, MLP speculators and MTP heads
are refused by name (they need trained draft heads). Method inference follows vLLM: `"method"` wins;
without it `"model": "ngram"` / `"[ngram]"` or a `prompt_lookup_*` key without a model means ngram,
and any other `"model"` a draft model.

ngram lookup defaults follow vLLM's `SpeculativeConfig.__post_init__` (v0.8 and later, which the old
`--ngram-prompt-lookup-*` flags also go through): neither `prompt_lookup_min` nor `prompt_lookup_max`
given -> both 5; only one given -> it is used for both (so `--ngram-prompt-lookup-max 4` alone means
min = max = 4; vLLM 0.6's min default of 1 is not followed). `num_speculative_tokens` is required, as
vLLM requires it for both methods; it is capped at `MAX_SPECULATIVE_TOKENS` (16: a longer draft is
almost never accepted whole, and each slot costs a verify row and a KV slot).

Checks happen in two places, both raising ConfigError naming `--speculative-config` (or the flag):
`validate_speculative_args` (from `EngineArgs.validate()`, before any model file is read) and
`resolve_speculative_config` (from resolve.py, once the target's config.json, task and
implementation are known; reads the draft's config.json).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError, require
from aserve.config.hf_config import (
    SUPPORTED_ARCHITECTURES,
    ArchConfig,
    architecture_of,
    derived_max_model_len,
    read_hf_config,
)

logger = logging.getLogger("aserve.config")

SPEC_METHODS = ("ngram", "draft_model")
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
MAX_SPECULATIVE_TOKENS = 16
NGRAM_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given
# The keys `speculative_config` accepts (vLLM's names).
SPEC_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "draft_tensor_parallel_size", "max_model_len", "disable_by_batch_size", "acceptance_method",
                    "posterior_threshold", "posterior_alpha", "disable_logprobs", "disable_mqa_scorer",
                    "quantization")
_NGRAM_MODELS = ("ngram", "[ngram]")
_HEADS = "needs trained draft heads, not implemented; use ngram or draft_model"
# vLLM's other method names, refused with the reason.
REFUSED_SPEC_METHODS = {
    "eagle": f"EAGLE {_HEADS}",
    "eagle3": f"EAGLE-3 {_HEADS}",
    "medusa": f"Medusa {_HEADS}",
    "mlp_speculator": f"MLP speculators {_HEADS}",
    **{name: f"multi-token prediction ({name}) {_HEADS}" for name in (
        "mtp", "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp", "mimo_mtp", "glm4_moe_mtp", "longcat_flash_mtp")},
    "suffix": "suffix decoding is not implemented; use ngram (prompt lookup) or draft_model",
    "ngram_gpu": "aserve's ngram lookup runs on the host for every device; use method 'ngram'",
}
_ARG = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding. Every value is checked; consumers trust them.

    `num_speculative_tokens` (k, 1..16) tokens are proposed per decoding request per step and verified
    in one target forward over k+1 positions. ngram: the longest n-gram (`prompt_lookup_max` down to
    `prompt_lookup_min`, 1 <= min <= max) ending the sequence is looked up in it. draft_model:
    `draft_model_path` is the draft's local Hugging Face folder, `draft_arch` its ArchConfig (a native
    causal family with the target's vocab_size). `max_model_len`: a request whose length reaches it is
    not speculated (the draft's context caps it; None: no cap below the target's max_model_len).
    `disable_by_batch_size`: no speculation in a step with more running requests than this (None: always).
    `acceptance_method`: "rejection_sampler" (exact target distribution) or
    "typical_acceptance_sampler" (with `posterior_threshold` in (0, 1] and `posterior_alpha` >= 0).
    `disable_logprobs`: requests that ask for logprobs are not speculated.
    """

    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram only; 0 for draft_model
    prompt_lookup_min: int = 0
    draft_model_path: str | None = None
    draft_arch: ArchConfig | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    disable_logprobs: bool = False

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a draft model needs past the scheduled tokens (its proposals); 0 for ngram."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def parse_speculative_config(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """`speculative_config` as a dict (JSON text parsed; None and {} -> None). ConfigError naming
    --speculative-config for text that is not a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config: not valid JSON ({exc})") from None
    require(value is None or isinstance(value, dict), _ARG, f"expected a JSON object, got {value!r}")
    return dict(value) if value else None


def merge_speculative_flags(value: dict[str, Any] | str | None, flags: dict[str, tuple[str, Any]]) -> dict | None:
    """`value` (the speculative_config given, if any) with the older flags' values added: `flags` maps a
    speculative_config key to (the old flag, its value). A key given both ways with different values is
    a ConfigError naming both."""
    merged = parse_speculative_config(value) or {}
    for key, (flag, given) in flags.items():
        require(key not in merged or merged[key] == given, _ARG,
                f"{key}={merged.get(key)!r} contradicts {flag} {given!r}; give one")
        merged[key] = given
    return merged or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _method_of(spec: dict[str, Any]) -> str:
    """The method `spec` asks for, inferred as vLLM does; refused names raise ConfigError."""
    method, model = spec.get("method"), spec.get("model")
    require(method is None or isinstance(method, str), _ARG, f"method must be a string, got {method!r}")
    require(model is None or isinstance(model, str), _ARG, f"model must be a string (a path), got {model!r}")
    if method is None:
        if model in _NGRAM_MODELS or (model is None and ("prompt_lookup_max" in spec or "prompt_lookup_min" in spec)):
            return "ngram"
        require(model is not None, _ARG, "give 'method' (ngram or draft_model) or 'model' (a draft model's "
                "name or folder, or '[ngram]'); e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
        require("eagle" not in model.lower(), _ARG, f"{model!r} looks like an EAGLE head: {REFUSED_SPEC_METHODS['eagle']}")
        return "draft_model"
    method = "ngram" if method == "[ngram]" else method
    require(method not in REFUSED_SPEC_METHODS, _ARG, f"method {method!r}: {REFUSED_SPEC_METHODS.get(method)}")
    require(method in SPEC_METHODS, _ARG, f"unknown method {method!r}; implemented: {SPEC_METHODS}")
    if method == "ngram":
        require(model in (None, *_NGRAM_MODELS), _ARG, f"method 'ngram' takes no draft model (got model={model!r})")
    else:
        require(model is not None and model not in _NGRAM_MODELS, _ARG,
                "method 'draft_model' needs 'model': the draft model's name or folder")
    return method


def _checked(spec: dict[str, Any]) -> dict[str, Any]:
    """Every key of `spec` checked (types, ranges, refusals) and defaults filled: the fields of
    `SpeculativeConfig` other than the draft's resolved path and arch, plus "model"."""
    unknown = sorted(set(spec) - set(SPEC_CONFIG_KEYS))
    require(not unknown, _ARG, f"unknown key(s) {unknown}; known: {sorted(SPEC_CONFIG_KEYS)}")
    method = _method_of(spec)
    k = spec.get("num_speculative_tokens")
    require(k is not None, _ARG, "num_speculative_tokens is required (the tokens proposed per step)")
    require(_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS, _ARG,
            f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if method == "ngram":
        lo, hi = (NGRAM_DEFAULT_LOOKUP, NGRAM_DEFAULT_LOOKUP) if lo is None and hi is None else (
            lo if lo is not None else hi, hi if hi is not None else lo)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            require(_is_int(n) and n >= 1, _ARG, f"{name} must be an integer >= 1, got {n!r}")
        require(lo <= hi, _ARG, f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    else:
        require(lo is None and hi is None, _ARG, "prompt_lookup_min / prompt_lookup_max apply to method 'ngram' "
                "only; drop them for a draft model")
        lo = hi = 0
    tp = spec.get("draft_tensor_parallel_size")
    require(tp is None or tp == 1, _ARG, f"draft_tensor_parallel_size: only 1 is implemented (the draft runs "
            f"unsharded), got {tp!r}")
    quant = spec.get("quantization")
    require(quant is None, _ARG, f"quantization {quant!r}: quantized draft models are not implemented; drop the key")
    cap = spec.get("max_model_len")
    require(cap is None or (_is_int(cap) and cap >= 1), _ARG, f"max_model_len must be an integer >= 1, got {cap!r}")
    batch = spec.get("disable_by_batch_size")
    require(batch is None or (_is_int(batch) and batch >= 1), _ARG,
            f"disable_by_batch_size must be an integer >= 1, got {batch!r}")
    acceptance = spec.get("acceptance_method", "rejection_sampler")
    require(acceptance in ACCEPTANCE_METHODS, _ARG,
            f"acceptance_method must be one of {ACCEPTANCE_METHODS}, got {acceptance!r}")
    threshold = spec.get("posterior_threshold", 0.09)
    require(_is_number(threshold) and 0 < threshold <= 1, _ARG,
            f"posterior_threshold must be a number in (0, 1], got {threshold!r}")
    alpha = spec.get("posterior_alpha", 0.3)
    require(_is_number(alpha) and alpha >= 0, _ARG, f"posterior_alpha must be a number >= 0, got {alpha!r}")
    for name in ("disable_logprobs", "disable_mqa_scorer"):
        value = spec.get(name)
        require(value is None or isinstance(value, bool), _ARG, f"{name} must be true or false, got {value!r}")
    return {"method": method, "model": spec.get("model"), "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi, "max_model_len": cap, "disable_by_batch_size": batch,
            "acceptance_method": acceptance, "posterior_threshold": float(threshold),
            "posterior_alpha": float(alpha), "disable_logprobs": bool(spec.get("disable_logprobs")),
            "disable_mqa_scorer": bool(spec.get("disable_mqa_scorer"))}


_POOLING_TASKS = ("embed", "embedding", "classify", "score", "encode")


def validate_speculative_args(args: Any) -> None:
    """Check `args.speculative_config` (an EngineArgs) and `args.num_lookahead_slots` without reading
    any model file; ConfigError naming the flag. Refuses: a pooling --task / --runner, --model-impl
    transformers, a draft model with --tensor-parallel-size > 1."""
    require(_is_int(args.num_lookahead_slots) and args.num_lookahead_slots >= 0, "num_lookahead_slots",
            f"must be >= 0, got {args.num_lookahead_slots!r}")
    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return
    checked = _checked(spec)
    pooling = args.task in _POOLING_TASKS or args.runner == "pooling"
    require(not pooling, _ARG, f"speculative decoding generates text; a pooling model (--task {args.task}, "
            f"--runner {args.runner}) runs no decode steps")
    require(args.model_impl != "transformers", _ARG, "speculative decoding needs aserve's native model classes "
            "(verification runs k+1 query tokens through aserve's attention); not with --model-impl transformers")
    if checked["method"] == "draft_model":
        require(args.tensor_parallel_size == 1, _ARG, "a draft model with --tensor-parallel-size "
                f"{args.tensor_parallel_size} is not implemented (the draft is not sharded); use method 'ngram' "
                "or --tensor-parallel-size 1")


def draft_model_name(args: Any) -> str | None:
    """The draft model's `model` string (a name, Hub id, folder or .gguf, resolved like --model by
    aserve.model_source.resolve_model) when `args` asks for a draft model; else None. Call after
    `args.validate()`."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return None
    checked = _checked(spec)
    return checked["model"] if checked["method"] == "draft_model" else None


def resolve_speculative_config(args: Any, target_arch: ArchConfig, *, model_impl: str, is_pooling: bool,
                               max_model_len: int, draft_model_path: str | None = None) -> SpeculativeConfig | None:
    """The frozen config for validated `args` (None without speculative_config). `target_arch`,
    `model_impl` ("aserve" | "transformers"), `is_pooling` and `max_model_len` are the target's resolved
    values; `draft_model_path` is the local folder the model source resolved the draft's `model` to
    (None: `model` itself must be a local folder). Reads the draft's config.json: a non-native family or
    a vocab_size other than the target's is a ConfigError naming both and the draft's path."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return None
    s = _checked(spec)
    require(not is_pooling, _ARG, "speculative decoding generates text; this model serves a pooling task")
    require(model_impl != "transformers", _ARG, "speculative decoding needs aserve's native model classes; "
            f"{target_arch.architecture} runs on the Transformers backend here")
    if s["disable_mqa_scorer"]:
        logger.warning("--speculative-config: disable_mqa_scorer changes nothing (aserve verifies drafts with "
                       "its own multi-token attention; it has no MQA scorer)")
    cap = s["max_model_len"]
    require(cap is None or cap <= max_model_len, _ARG,
            f"max_model_len ({cap}) must be <= the target's max_model_len ({max_model_len})")
    draft_path, draft_arch = None, None
    if s["method"] == "draft_model":
        draft_path, draft_arch = _draft_arch(draft_model_path or os.path.expanduser(s["model"]), s["model"])
        require(draft_arch.vocab_size == target_arch.vocab_size, _ARG,
                f"the draft model {draft_path!r} has vocab_size {draft_arch.vocab_size}, the target "
                f"{target_arch.vocab_size}; a draft must share the target's vocabulary")
        draft_len = derived_max_model_len(draft_arch)
        cap = draft_len if cap is None else min(cap, draft_len)
    return SpeculativeConfig(
        method=s["method"], num_speculative_tokens=s["num_speculative_tokens"],
        prompt_lookup_max=s["prompt_lookup_max"], prompt_lookup_min=s["prompt_lookup_min"],
        draft_model_path=draft_path, draft_arch=draft_arch,
        max_model_len=cap if cap is not None and cap < max_model_len else None,
        disable_by_batch_size=s["disable_by_batch_size"], acceptance_method=s["acceptance_method"],
        posterior_threshold=s["posterior_threshold"], posterior_alpha=s["posterior_alpha"],
        disable_logprobs=s["disable_logprobs"])


def _draft_arch(path: str, model: str) -> tuple[str, ArchConfig]:
    """The draft folder's ArchConfig, read as the target's is; ConfigError naming --speculative-config."""
    require(os.path.isfile(os.path.join(path, "config.json")), _ARG,
            f"draft model {model!r}: no config.json in {path!r} (give a local Hugging Face folder, or a name "
            "the model source resolves)")
    try:
        cfg = read_hf_config(path)
        name = architecture_of(cfg)
        require(name in SUPPORTED_ARCHITECTURES, _ARG,
                f"draft model {path!r}: architecture {name!r} is not a causal LM family aserve implements "
                f"natively; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return path, ArchConfig.from_hf_dict(cfg)
    except ConfigError as exc:
        if str(exc).startswith("--speculative-config"):
            raise
        raise ConfigError(f"--speculative-config: draft model {path!r}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"--speculative-config: draft model {path!r}: bad config.json ({exc!r})") from None


def resolve_num_lookahead_slots(args: Any, spec: SpeculativeConfig | None) -> int:
    """`SchedulerConfig.num_lookahead_slots`: max(--num-lookahead-slots, what the speculation needs)."""
    return max(args.num_lookahead_slots, spec.num_lookahead_slots if spec is not None else 0)
