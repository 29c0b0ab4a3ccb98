"""vLLM argument names aserve does not implement as `EngineArgs` fields: deprecated aliases and no-ops
(accepted with a one-line deprecation warning naming the replacement), and names refused at start-up
with the reason (never "unrecognized arguments" / "unknown engine argument").

One table, `COMPAT_ARGS`, drives both the CLI (`add_compat_arguments`, each name a flag) and
`EngineArgs.from_kwargs` / `LLM(...)` (`apply_compat`). A refused name given with its default value is
accepted silently: only a value that would change behaviour is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError, flag_name
from aserve.config.speculative import merge_speculative_flags

logger = logging.getLogger("aserve.config")

_TEXT_ONLY = "aserve serves text-only models (multimodal inputs are not implemented)"
_PROMPT_ADAPTER = "prompt adapters were removed from vLLM (0.8) and are not implemented by aserve"


@dataclass(frozen=True)
class CompatArg:
    """kind: 'alias' (value goes to `target`), 'noop' (deprecated, does nothing), 'refused' (any value
    but `default` / `accepted` is a ConfigError with `reason`), 'spec' (a deprecated speculative decoding
    flag: its value becomes key `target` of speculative_config). type: bool | bool_opt | int | float |
    str | json | list (argparse mapping). server: a server flag, not an engine keyword."""

    kind: str
    type: str
    default: Any = None
    reason: str = ""
    target: str | None = None  # alias: the EngineArgs / server field it sets
    target_value: Any = None  # alias of a flag: the value it sets (None: the flag's own value)
    accepted: tuple[Any, ...] = ()  # refused: other values that mean aserve's behaviour
    server: bool = False


def _refused(tp: str, default: Any, reason: str, **kw: Any) -> CompatArg:
    return CompatArg("refused", tp, default, reason, **kw)


COMPAT_ARGS: dict[str, CompatArg] = {
    # -- vLLM's own deprecated aliases and no-ops ---------------------------------------------------
    "use_v2_block_manager": CompatArg("noop", "bool", False, "deprecated no-op in vLLM: aserve's paged KV cache "
                                      "is the only block manager; drop the flag"),
    "max_paddings": CompatArg("noop", "int", None, "deprecated no-op in vLLM (padding is not configurable); "
                              "drop the flag"),
    "disable_custom_all_reduce": CompatArg("noop", "bool", False, "no-op: aserve has no custom all-reduce "
                                           "(tensor parallelism uses torch.distributed's all-reduce)"),
    "show_hidden_metrics_for_version": CompatArg("noop", "str", None, "no-op: aserve hides no deprecated metrics"),
    "max_context_len_to_capture": CompatArg("alias", "int", None, "deprecated: use --max-seq-len-to-capture",
                                            target="max_seq_len_to_capture"),
    "forced_num_gpu_blocks": CompatArg("alias", "int", None, "deprecated: use --num-gpu-blocks-override",
                                       target="num_gpu_blocks_override"),
    "worker_use_ray": CompatArg("alias", "bool", False, "deprecated: use --distributed-executor-backend ray",
                                target="distributed_executor_backend", target_value="ray"),
    # -- vLLM's newer spellings ---------------------------------------------------------------------
    "enable_log_requests": CompatArg("alias", "bool", False, "", target="disable_log_requests",
                                     target_value=False, server=True),
    # -- refused: multimodal ------------------------------------------------------------------------
    **{name: _refused(tp, default, _TEXT_ONLY) for name, tp, default in (
        ("image_input_type", "str", None), ("image_token_id", "int", None), ("image_input_shape", "str", None),
        ("image_feature_size", "int", None), ("image_processor", "str", None),
        ("image_processor_revision", "str", None), ("disable_image_processor", "bool", False),
        ("limit_mm_per_prompt", "json", None), ("mm_processor_kwargs", "json", None),
        ("disable_mm_preprocessor_cache", "bool", False), ("allowed_local_media_path", "str", ""))},
    # -- refused: prompt adapters -------------------------------------------------------------------
    "enable_prompt_adapter": _refused("bool", False, _PROMPT_ADAPTER),
    "max_prompt_adapters": _refused("int", 1, _PROMPT_ADAPTER),
    "max_prompt_adapter_token": _refused("int", 0, _PROMPT_ADAPTER),
    # -- refused: other vLLM machinery aserve does not have -----------------------------------------
    "kv_transfer_config": _refused("json", None, "disaggregated prefill (KV transfer between instances) is not "
                                   "implemented"),
    "worker_cls": _refused("str", "auto", "custom worker classes are not supported: aserve's workers are its own",
                           accepted=("",)),
    "worker_extension_cls": _refused("str", "", "worker extension classes are not supported"),
    "override_neuron_config": _refused("json", None, "AWS Neuron devices are not supported (devices: cpu, cuda)"),
    "additional_config": _refused("json", None, "platform plugins' additional config is not supported"),
    "ray_workers_use_nsight": _refused("bool", False, "Nsight profiling of the Ray workers is not supported"),
    "engine_use_ray": _refused("bool", False, "removed from vLLM: the engine runs in the server's process; "
                               "--distributed-executor-backend ray puts the model workers on Ray"),
    "enable_expert_parallel": _refused("bool", False, "expert parallelism is not implemented (MoE experts are split by --tensor-parallel-size instead)"),
    "tokenizer_extension_path": _refused("str", None, "a vendor (AIAK) extension: custom vllm_extension.py "
                                         "tokenizers are not supported"),
    "multi_query_mode": _refused("bool", False, "an option of the quantization tool, not of a server: "
                                 "aserve quantize ... --multi-query-mode"),
    "use_tqdm_on_load": _refused("bool_opt", True, "", accepted=(False,)),  # aserve shows no loading bar
    # -- speculative decoding's older flags: each sets one key of --speculative-config ----------------
    **{name: CompatArg("spec", tp, default, f"deprecated: use --speculative-config's {key!r} key", target=key)
       for name, tp, default, key in (
        ("speculative_model", "str", None, "model"),
        ("speculative_model_quantization", "str", None, "quantization"),
        ("num_speculative_tokens", "int", None, "num_speculative_tokens"),
        ("speculative_draft_tensor_parallel_size", "int", None, "draft_tensor_parallel_size"),
        ("speculative_max_model_len", "int", None, "max_model_len"),
        ("speculative_disable_by_batch_size", "int", None, "disable_by_batch_size"),
        ("ngram_prompt_lookup_max", "int", None, "prompt_lookup_max"),
        ("ngram_prompt_lookup_min", "int", None, "prompt_lookup_min"),
        ("spec_decoding_acceptance_method", "str", "rejection_sampler", "acceptance_method"),
        ("typical_acceptance_sampler_posterior_threshold", "float", None, "posterior_threshold"),
        ("typical_acceptance_sampler_posterior_alpha", "float", None, "posterior_alpha"),
        ("disable_logprobs_during_spec_decoding", "bool_opt", None, "disable_logprobs"),
        ("speculative_disable_mqa_scorer", "bool", False, "disable_mqa_scorer"))},
    "pooler_config": CompatArg("alias", "json", None, "", target="override_pooler_config"),
}


def _json(flag: str):
    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc})") from None

    parse.__name__ = "JSON"
    return parse


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `COMPAT_ARGS` name; `apply_compat` then aliases, warns or refuses."""
    group = parser.add_argument_group("vLLM flags that aserve aliases or refuses (see the README)")
    for name, arg in COMPAT_ARGS.items():
        flag = flag_name(name)
        if arg.kind in ("alias", "spec") and arg.reason:
            help_text = arg.reason
        elif arg.kind == "alias":
            help_text = f"vLLM's newer spelling: sets {flag_name(arg.target or '')} to {arg.target_value!r}"
        elif arg.kind == "noop":
            help_text = arg.reason if arg.reason.startswith("deprecated") else f"deprecated: {arg.reason}"
        else:
            help_text = f"refused: {arg.reason}" if arg.reason else "accepted (aserve shows no loading bar)"
        kwargs: dict[str, Any] = {"dest": name, "default": arg.default, "help": help_text}
        if arg.type == "bool":
            kwargs["action"] = "store_true"
        elif arg.type == "bool_opt":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif arg.type == "json":
            kwargs["type"] = _json(flag)
        elif arg.type == "list":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}[arg.type]
        group.add_argument(flag, **kwargs)


def apply_compat(values: dict[str, Any], server: bool = False) -> dict[str, Any]:
    """Removes the `COMPAT_ARGS` names from `values` (engine keywords, or with `server` every parsed
    flag); a deprecated one logs one warning naming its replacement, an alias sets its target, a
    refused one with a value other than its default raises ConfigError naming the flag and the reason.
    Server-only names are left alone unless `server` (so `LLM(middleware=...)` stays unknown)."""
    out = dict(values)
    spec_flags: dict[str, tuple[str, Any]] = {}  # speculative_config key -> (old flag, value)
    for name, arg in COMPAT_ARGS.items():
        if name not in out or (arg.server and not server):
            continue
        value = out.pop(name)
        if value == arg.default or (value in (None, [], ()) and arg.default in (None, "")):
            continue
        flag = flag_name(name)
        if arg.kind == "noop":
            logger.warning("%s is deprecated and does nothing: %s", flag, arg.reason)
        elif arg.kind == "spec":
            logger.warning("%s is deprecated: use --speculative-config '{\"%s\": %s}'", flag, arg.target,
                           json.dumps(value))
            spec_flags[arg.target or ""] = (flag, value)
        elif arg.kind == "alias":
            target = arg.target or ""
            new = value if arg.target_value is None else arg.target_value
            if arg.reason:
                logger.warning("%s is deprecated: use %s (%s %r)", flag, flag_name(target), flag_name(target), new)
            if target in values and values[target] not in (new, _default_of(target)):
                raise ConfigError(f"{flag}: contradicts {flag_name(target)}={values[target]!r}; give one")
            out[target] = new
        elif value not in arg.accepted:
            raise ConfigError(f"{flag}: {arg.reason} (got {value!r}; only the default {arg.default!r} is accepted)")
    if spec_flags:
        out["speculative_config"] = merge_speculative_flags(out.get("speculative_config"), spec_flags)
    return out


def _default_of(field: str) -> Any:
    import dataclasses

    from aserve.config.engine_args import EngineArgs  # noqa: PLC0415 (engine_args imports this module)

    if field == "disable_log_requests":  # a server flag (aserve.server.args.ServerArgs)
        return False
    for f in dataclasses.fields(EngineArgs):
        if f.name == field:
            return f.default
    return None
