"""How a pooling model turns hidden states into one vector (or score) per sequence: `PoolerConfig`,
resolved from the architecture's defaults, then the sentence-transformers files of the model folder
(`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`), then vLLM's
`--override-pooler-config` JSON, each layer overriding only the fields it sets.

Standard library only (no torch), so the config, engine and server layers may read it.

Defaults per architecture (vLLM's): an encoder (`BertModel`) pools CLS, normalized; a causal decoder
serving embeddings pools LAST (the last token, which has seen the whole sequence), normalized; a
`*ForSequenceClassification` model pools CLS into its classifier, whose logits get softmax (sigmoid
when it has one label) for `classify` / `score` and stay raw for `embed`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any


class PoolingType(str, Enum):
    LAST = "LAST"  # the sequence's last token row
    MEAN = "MEAN"  # the mean of every token row (special tokens included, as sentence-transformers)
    CLS = "CLS"  # the first token row
    ALL = "ALL"  # every token row (one vector per token)


POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass(frozen=True)
class PoolerConfig:
    """A field left None is unset: a later layer (or the default) decides it. `resolve_pooler_config`
    returns one with `pooling_type`, `normalize` and `softmax` set."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None  # L2-normalize each pooled vector (after any `dimensions` truncation)
    softmax: bool | None = None  # classifier logits -> probabilities (softmax; sigmoid with one label)
    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` values (before normalizing)
    max_seq_length: int | None = None  # sentence-transformers' truncation, in tokens (special tokens included)

    def merged(self, override: PoolerConfig | None) -> PoolerConfig:
        """This config with every field `override` sets replaced."""
        if override is None:
            return self
        return dataclasses.replace(self, **{f.name: getattr(override, f.name) for f in dataclasses.fields(override)
                                            if getattr(override, f.name) is not None})


_OVERRIDE_KEYS = ("pooling_type", "normalize", "softmax", "dimensions")


def parse_pooler_config(value: str | dict[str, Any] | None, flag: str = "--override-pooler-config") -> PoolerConfig:
    """vLLM's `--override-pooler-config` / `--pooler-config`: a JSON object (or its dict) with any of
    `pooling_type` (LAST | MEAN | CLS | ALL, any case), `normalize`, `softmax` (booleans) and
    `dimensions` (a positive int). None or "" gives an empty config. Raises ValueError naming `flag`
    and the field on anything else."""
    if value is None or value == "":
        return PoolerConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(value).__name__}")  # noqa: TRY004 (a flag's value)
    unknown = sorted(set(value) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"{flag}: unknown field(s) {unknown}; supported: {list(_OVERRIDE_KEYS)}")
    fields: dict[str, Any] = {}
    if value.get("pooling_type") is not None:
        fields["pooling_type"] = parse_pooling_type(value["pooling_type"], f"{flag}: pooling_type")
    for key in ("normalize", "softmax"):
        if value.get(key) is not None:
            if not isinstance(value[key], bool):
                raise ValueError(f"{flag}: {key} must be true or false, got {value[key]!r}")
            fields[key] = value[key]
    if value.get("dimensions") is not None:
        dims = value["dimensions"]
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise ValueError(f"{flag}: dimensions must be a positive integer, got {dims!r}")
        fields["dimensions"] = dims
    return PoolerConfig(**fields)


def parse_pooling_type(value: Any, what: str = "pooling_type") -> PoolingType:
    """`value` (any case) as a PoolingType; ValueError naming `what` and the choices otherwise."""
    try:
        return PoolingType(str(value).upper())
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not a pooling type; choose one of "
                         f"{[t.value for t in PoolingType]}") from None


# sentence-transformers' Pooling modes -> ours (the others are not implemented and refused).
_ST_POOLING_MODES = {"pooling_mode_cls_token": PoolingType.CLS, "pooling_mode_mean_tokens": PoolingType.MEAN,
                     "pooling_mode_lasttoken": PoolingType.LAST}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODE_NAMES = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN, "lasttoken": PoolingType.LAST}
_ST_MODULE = "sentence_transformers.models."
_ST_PASSIVE_MODULES = ("Transformer", "Pooling", "Normalize")  # the ones this reader understands


def read_sentence_transformers_config(model_path: str) -> PoolerConfig | None:
    """What the folder's sentence-transformers files say (None when it has no `modules.json`):
    `pooling_type` from the Pooling module's config, `normalize` = whether a Normalize module follows,
    `max_seq_length` from `sentence_bert_config.json`. Raises ValueError for modules or pooling modes
    that change the vectors in ways not implemented (Dense layers, max / weighted-mean pooling)."""
    modules = _read_json(os.path.join(model_path, "modules.json"))
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise ValueError(f"{model_path}/modules.json: expected a list of modules")  # noqa: TRY004 (a file's content)
    pooling_type: PoolingType | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        short = kind.removeprefix(_ST_MODULE)
        if short not in _ST_PASSIVE_MODULES:
            raise ValueError(f"{model_path}/modules.json: sentence-transformers module {kind!r} is not "
                             f"implemented (supported: {', '.join(_ST_PASSIVE_MODULES)})")
        if short == "Normalize":
            normalize = True
        elif short == "Pooling":
            cfg = _read_json(os.path.join(model_path, str(module.get("path", "")), "config.json")) or {}
            pooling_type = _st_pooling_type(cfg, f"{model_path}/{module.get('path')}/config.json")
    bert_cfg = _read_json(os.path.join(model_path, "sentence_bert_config.json")) or {}
    max_len = bert_cfg.get("max_seq_length")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize,
                        max_seq_length=int(max_len) if max_len is not None else None)


def _st_pooling_type(cfg: dict[str, Any], where: str) -> PoolingType | None:
    if isinstance(cfg.get("pooling_mode"), str):  # newer files name the mode
        mode = cfg["pooling_mode"].lower()
        if mode not in _ST_MODE_NAMES:
            raise ValueError(f"{where}: pooling_mode {mode!r} is not implemented (supported: {sorted(_ST_MODE_NAMES)})")
        return _ST_MODE_NAMES[mode]
    unsupported = [k for k in _ST_UNSUPPORTED_MODES if cfg.get(k)]
    chosen = [t for k, t in _ST_POOLING_MODES.items() if cfg.get(k)]
    if unsupported or len(chosen) > 1:
        raise ValueError(f"{where}: pooling modes {unsupported + [t.value for t in chosen]} are not implemented "
                         "(one of CLS, MEAN or last-token pooling is)")
    return chosen[0] if chosen else None


def default_pooler_config(architecture: str, task: str = "embed") -> PoolerConfig:
    """The architecture's default for `task` (one of `POOLING_TASKS`; see the module docstring)."""
    if task not in POOLING_TASKS:
        raise ValueError(f"--task: {task!r} is not a pooling task (one of {list(POOLING_TASKS)})")
    if architecture.endswith("ForSequenceClassification"):
        return PoolerConfig(pooling_type=PoolingType.CLS, normalize=False, softmax=task in ("classify", "score"))
    if architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return PoolerConfig(pooling_type=PoolingType.LAST, normalize=task != "encode", softmax=False)
    return PoolerConfig(pooling_type=PoolingType.CLS, normalize=task != "encode", softmax=False)


def resolve_pooler_config(model_path: str | None, architecture: str, task: str = "embed",
                          override: str | dict[str, Any] | PoolerConfig | None = None) -> PoolerConfig:
    """The pooling a model folder serves: the architecture's default, then its sentence-transformers
    files (when present), then `override` (`--override-pooler-config`). Raises ValueError (naming the
    file or the flag) on anything not implemented or malformed."""
    config = default_pooler_config(architecture, task)
    if model_path is not None:
        config = config.merged(read_sentence_transformers_config(model_path))
    if not isinstance(override, PoolerConfig):
        override = parse_pooler_config(override)
    return config.merged(override)


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
