"""`--task`, `--runner` and `--override-pooler-config` (vLLM's names): whether the engine generates
text or pools (embeddings, classification, cross-encoder scores), and how a pooling model pools.

Tasks (vLLM's): `generate` (a causal LM), `embed` (vLLM's older spelling `embedding`: one vector per
input; `/v1/embeddings`, `LLM.embed`, and cosine `/score` / `/rerank`), `classify` and `score` (a
`*ForSequenceClassification` head: class probabilities, cross-encoder scores of text pairs; the two
name the same served model), `encode` (raw pooled hidden states, unnormalized). `auto` picks
`generate` for causal LMs and a pooling task for encoder-only architectures (`classify` for a
classifier head, else `embed`); `--runner pooling` with `auto` does the same for any architecture,
so a causal family serves last-token embeddings (Qwen3-Embedding, gte-Qwen2 style). One engine
serves one task kind: generation and pooling requests are never mixed on one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError, require
from aserve.config.hf_config import ENCODER_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from aserve.config.pooler import PoolerConfig, PoolingType, parse_pooler_config, resolve_pooler_config

TASK_CHOICES = ("auto", "generate", "embed", "embedding", "classify", "score", "encode")
RUNNER_CHOICES = ("auto", "generate", "pooling")
_TASK_ALIASES = {"embedding": "embed"}
_REFUSED_TASKS = {"reward": "reward models are not implemented (use --task classify for a classifier head)",
                  "transcription": "speech models are not implemented (aserve serves text models)"}


@dataclass(frozen=True)
class PoolingConfig:
    """What a pooling engine serves: `task` ("embed" | "classify" | "score" | "encode") and the resolved
    `pooler` (pooling_type, normalize and softmax set; see aserve/config/pooler.py)."""

    task: str
    pooler: PoolerConfig
    # config.json's `is_matryoshka` / `matryoshka_dimensions`: whether (and to which sizes) a request's
    # `dimensions` may shorten the embeddings
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def is_classifier(self) -> bool:
        """Classification / cross-encoder scores (a classifier head's outputs), not embeddings."""
        return self.task in ("classify", "score")


def validate_pooling_args(args: Any) -> None:
    """Check --task / --runner / --override-pooler-config without the model; ConfigError naming the flag."""
    require(args.task not in _REFUSED_TASKS, "task", f"{args.task!r}: {_REFUSED_TASKS.get(args.task, '')}")
    require(args.task in TASK_CHOICES, "task", f"must be one of {TASK_CHOICES}, got {args.task!r}")
    require(args.runner != "draft", "runner",
            "'draft' (a speculative decoding draft model) is not implemented yet (issue 22, speculative decoding)")
    require(args.runner in RUNNER_CHOICES, "runner", f"must be one of {RUNNER_CHOICES}, got {args.runner!r}")
    task = _TASK_ALIASES.get(args.task, args.task)
    require(not (args.runner == "generate" and task not in ("auto", "generate")), "runner",
            f"'generate' cannot serve --task {args.task}; use --runner pooling (or auto)")
    require(not (args.runner == "pooling" and task == "generate"), "runner",
            "'pooling' cannot serve --task generate; use --runner generate (or auto)")
    try:
        parse_pooler_config(args.override_pooler_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def bare_model_architecture(architecture: str) -> str | None:
    """The causal class a bare decoder's name stands for (`Qwen2Model` -> `Qwen2ForCausalLM`), when it
    is a supported family; None otherwise. Such checkpoints (gte-Qwen2 style) can only pool."""
    if architecture.endswith("Model") and not architecture.endswith("LMHeadModel"):
        causal = architecture.removesuffix("Model") + "ForCausalLM"
        if causal in SUPPORTED_ARCHITECTURES:
            return causal
    return None


def resolve_task(args: Any, architecture: str, bare_decoder: bool = False) -> str:
    """The served task for `architecture` ("generate" or a pooling task); `bare_decoder`: config.json
    named a bare decoder (`Qwen2Model`), which has no LM head. ConfigError naming --task otherwise."""
    is_encoder = architecture in ENCODER_ARCHITECTURES
    is_classifier = architecture.endswith("ForSequenceClassification")
    task = _TASK_ALIASES.get(args.task, args.task)
    if task == "auto":
        if args.runner == "pooling" or is_encoder or bare_decoder:
            task = "classify" if is_classifier else "embed"
        else:
            task = "generate"
    if task == "generate":
        require(not is_encoder, "task", f"{architecture} is an encoder-only model: it cannot generate text; "
                "serve it with --task embed (or classify / score for a classifier head)")
        require(not bare_decoder, "task", "config.json names a bare decoder (no LM head), which cannot generate "
                "text; serve it with --task embed")
    if task in ("classify", "score"):
        require(is_classifier, "task", f"{task!r} needs a *ForSequenceClassification model (a classifier or "
                f"cross-encoder); {architecture} has no classifier head (use --task embed)")
    return task


def resolve_pooling_config(args: Any, architecture: str, model_path: str | None, task: str,
                           hf_cfg: dict[str, Any] | None = None) -> PoolingConfig | None:
    """None for `generate`; else the pooling config (the model folder's sentence-transformers files
    and --override-pooler-config applied). ConfigError naming the flag or file on what is not
    implemented (checked here, before any weights load)."""
    if task == "generate":
        return None
    require(args.tensor_parallel_size == 1, "tensor_parallel_size",
            "tensor parallelism is not implemented for pooling models (only 1)")
    require(args.pipeline_parallel_size == 1, "pipeline_parallel_size",
            "pipeline parallelism is not implemented for pooling models (only 1)")
    require(not args.enable_lora, "enable_lora", "LoRA adapters are not implemented for pooling models")
    require(args.quantization is None, "quantization", "quantized pooling models are not implemented")
    require(not args.calculate_kv_scales, "calculate_kv_scales", "not implemented for pooling models (use "
            "--quantization-param-path, or scales from the checkpoint)")
    try:
        pooler = resolve_pooler_config(model_path, architecture, task, args.override_pooler_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if task in ("classify", "score"):
        require(pooler.pooling_type != PoolingType.ALL, "override_pooler_config",
                "a classifier needs one row per sequence; pooling_type ALL is for --task encode / embed")
    hf_cfg = hf_cfg or {}
    dims = hf_cfg.get("matryoshka_dimensions")
    return PoolingConfig(task=task, pooler=pooler, is_matryoshka=bool(hf_cfg.get("is_matryoshka") or dims),
                         matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)


def needs_whole_prompt(architecture: str, pooling: PoolingConfig) -> bool:
    """Whether each prompt must be computed in one step with no prefix-cache hit: encoders attend
    bidirectionally with no KV cache; every pooling type but LAST reads every row of the prompt."""
    return architecture in ENCODER_ARCHITECTURES or pooling.pooler.pooling_type != PoolingType.LAST
