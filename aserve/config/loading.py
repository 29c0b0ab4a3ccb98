"""How weights are read: `--model-loader-extra-config`, `--max-parallel-loading-workers` and the tensorizer
load format (and the other loading flags: `check_loading_args`), checked once at start-up into a frozen `LoaderOptions` (aserve/model/loader.py and
aserve/model/tensorizer_io.py read it; they trust it).

`--model-loader-extra-config` (a JSON object, vLLM's keys per load format):
  auto / safetensors / pt / npcache  `enable_multithread_load` (bool: read the checkpoint's files on a
                                     thread pool), `num_threads` (int >= 1, default 8)
  tensorizer                         `tensorizer_uri` (required: the `.tensors` file written by
                                     `python -m aserve.model.tensorizer_io`), `num_readers` (int >= 1),
                                     `verify_hash` (bool)
  dummy / gguf                       none
Any other key is a ConfigError naming it and the keys the load format knows. `--max-parallel-loading-workers N`:
with tensor parallelism, at most N ranks read their weights at once (the others wait their wave).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError, require

_FLAG = "model_loader_extra_config"
_DEFAULT_KEYS = {"enable_multithread_load": bool, "num_threads": int}
_TENSORIZER_KEYS = {"tensorizer_uri": str, "num_readers": int, "verify_hash": bool}
_REFUSED_TENSORIZER_KEYS = {
    "encryption_keyfile": "encrypted tensorizer files are not implemented",
    "s3_access_key_id": "S3 sources are not implemented (give a local tensorizer_uri)",
    "s3_secret_access_key": "S3 sources are not implemented (give a local tensorizer_uri)",
    "s3_endpoint": "S3 sources are not implemented (give a local tensorizer_uri)",
}
DEFAULT_NUM_THREADS = 8
_CONFIG_FORMATS = ("auto", "hf")


@dataclass(frozen=True)
class LoaderOptions:
    """The checked loader options (see the module docstring)."""

    multithread_load: bool = False
    num_threads: int = DEFAULT_NUM_THREADS
    tensorizer_uri: str | None = None
    tensorizer_num_readers: int | None = None
    tensorizer_verify_hash: bool = False
    max_parallel_loading_workers: int | None = None  # None: every rank at once


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model-loader-extra-config: not valid JSON ({exc.msg})") from None
    require(isinstance(value, dict), _FLAG, f"must be a JSON object, got {type(value).__name__}")
    return value


def _check_types(given: dict[str, Any], known: dict[str, type]) -> None:
    for key, value in given.items():
        want = known[key]
        ok = isinstance(value, want) and (want is not int or not isinstance(value, bool))
        require(ok, _FLAG, f"{key!r} must be {want.__name__}, got {value!r}")


def resolve_loader_options(extra: Any, load_format: str, max_parallel_loading_workers: int | None) -> LoaderOptions:
    """`LoaderOptions` from the two flags for `load_format`; ConfigError naming the flag otherwise."""
    given = _as_dict(extra)
    workers = max_parallel_loading_workers
    require(workers is None or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1),
            "max_parallel_loading_workers", f"must be an integer >= 1, got {workers!r}")
    if load_format == "tensorizer":
        for key, why in _REFUSED_TENSORIZER_KEYS.items():
            require(key not in given, _FLAG, f"{key!r}: {why}")
        unknown = sorted(set(given) - set(_TENSORIZER_KEYS))
        require(not unknown, _FLAG, f"unknown key(s) {unknown} for --load-format tensorizer; known: "
                f"{sorted(_TENSORIZER_KEYS)}")
        _check_types(given, _TENSORIZER_KEYS)
        uri = given.get("tensorizer_uri")
        require(uri is not None, _FLAG, "--load-format tensorizer needs {\"tensorizer_uri\": \"PATH.tensors\"}")
        require(os.path.isfile(os.path.expanduser(uri)), _FLAG, f"tensorizer_uri {uri!r}: no such file")
        readers = given.get("num_readers")
        require(readers is None or readers >= 1, _FLAG, f"'num_readers' must be >= 1, got {readers}")
        return LoaderOptions(tensorizer_uri=os.path.expanduser(uri), tensorizer_num_readers=readers,
                             tensorizer_verify_hash=bool(given.get("verify_hash", False)),
                             max_parallel_loading_workers=workers)
    known = _DEFAULT_KEYS if load_format in ("auto", "safetensors", "pt", "npcache") else {}
    unknown = sorted(set(given) - set(known))
    require(not unknown, _FLAG, f"unknown key(s) {unknown} for --load-format {load_format}; known: {sorted(known)}")
    _check_types(given, known)
    threads = given.get("num_threads", DEFAULT_NUM_THREADS)
    require(threads >= 1, _FLAG, f"'num_threads' must be >= 1, got {threads}")
    return LoaderOptions(multithread_load=bool(given.get("enable_multithread_load", False)), num_threads=threads,
                         max_parallel_loading_workers=workers)


def check_loading_args(args: Any) -> None:
    """The loading flags of an EngineArgs (`args`), each refused by name when it cannot be honoured."""
    require(args.config_format in _CONFIG_FORMATS, "config_format",
            f"must be 'auto' or 'hf' (aserve reads Hugging Face's config.json only; the 'mistral' params.json "
            f"format is not implemented), got {args.config_format!r}")
    require(args.code_revision is None or not args.trust_remote_code, "code_revision",
            f"{args.code_revision!r} with --trust-remote-code: aserve loads local folders and runs no "
            "remote code from another Hub revision, so a code revision would be ignored; drop --code-revision "
            "(or pin the model with --revision)")
    if args.hf_config_path is not None:
        require(os.path.isfile(os.path.join(os.path.expanduser(args.hf_config_path), "config.json")),
                "hf_config_path", f"no config.json in {args.hf_config_path!r}")
    patterns = args.resolved_ignore_patterns()
    require(all(p for p in patterns), "ignore_patterns", f"empty pattern in {args.ignore_patterns!r}")
    resolve_loader_options(args.model_loader_extra_config, args.load_format, args.max_parallel_loading_workers)
