"""`--quantization-param-path` and `--calculate-kv-scales`: where an fp8 KV cache's per-layer scales come
from when the checkpoint carries none (aserve/model/kv_scales.py applies them).

`--quantization-param-path FILE` is vLLM's JSON:

    {"model_type": "llama",
     "kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.5, "1": 0.7, ...}}}}

`scaling_factor` maps each tensor-parallel rank to {layer index: scale}, one scale per layer used for
both K and V. Checked at start-up: `validate_kv_scale_args` (no model needed: the file reads, its dtype
fits --kv-cache-dtype, every scale is a finite number > 0) and `resolve_kv_scales` (against the model:
its model_type, every rank 0..tp-1 and every layer 0..L-1 present). Both flags need an fp8 KV cache.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aserve.config.errors import ConfigError, require

# --kv-cache-dtype -> the dtype name a scales file must declare
_FILE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_FLAG = "--quantization-param-path"


def validate_kv_scale_args(args: Any) -> None:
    """EngineArgs checks that need no model: both flags need --kv-cache-dtype fp8*, not both at once,
    and the file must parse (`read_scales_file`)."""
    fp8 = args.kv_cache_dtype in _FILE_DTYPES
    require(not args.calculate_kv_scales or fp8, "calculate_kv_scales",
            f"computes fp8 KV-cache scales: it needs --kv-cache-dtype fp8 (fp8_e4m3 / fp8_e5m2), got "
            f"--kv-cache-dtype {args.kv_cache_dtype}")
    if args.quantization_param_path is None:
        return
    require(fp8, "quantization_param_path",
            f"holds fp8 KV-cache scales: it needs --kv-cache-dtype fp8 (fp8_e4m3 / fp8_e5m2), got "
            f"--kv-cache-dtype {args.kv_cache_dtype}")
    require(not args.calculate_kv_scales, "quantization_param_path",
            "and --calculate-kv-scales both set the fp8 KV-cache scales; pass one of them")
    read_scales_file(args.quantization_param_path, args.kv_cache_dtype)


def read_scales_file(path: str, kv_cache_dtype: str) -> tuple[str | None, dict[int, dict[int, float]]]:
    """(model_type or None, {tp rank: {layer: scale}}) from vLLM's JSON; ConfigError naming the flag for
    an unreadable file, a wrong shape or dtype, or a scale that is not a finite number > 0."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"{_FLAG}: cannot read {path!r} ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{_FLAG}: {path!r} is not valid JSON ({exc})") from None
    kv = data.get("kv_cache") if isinstance(data, dict) else None
    require(isinstance(kv, dict), "quantization_param_path",
            f"{path!r} has no \"kv_cache\" object (expected vLLM's format: {{\"model_type\": ..., \"kv_cache\": "
            f"{{\"dtype\": \"float8_e4m3fn\", \"scaling_factor\": {{\"0\": {{\"0\": 0.5, ...}}}}}}}})")
    dtype, want = kv.get("dtype"), _FILE_DTYPES[kv_cache_dtype]
    require(dtype == want, "quantization_param_path",
            f"{path!r} holds scales for KV dtype {dtype!r}, but --kv-cache-dtype {kv_cache_dtype} stores {want!r}")
    factors = kv.get("scaling_factor")
    require(isinstance(factors, dict) and bool(factors), "quantization_param_path",
            f"{path!r}: kv_cache.scaling_factor must be an object {{tp rank: {{layer: scale}}}}")
    out: dict[int, dict[int, float]] = {}
    for rank, layers in factors.items():
        require(isinstance(layers, dict), "quantization_param_path",
                f"{path!r}: scaling_factor[{rank!r}] must be an object {{layer: scale}}")
        out[_index(rank, "tensor-parallel rank", path)] = {
            _index(layer, "layer index", path): _scale(value, rank, layer, path) for layer, value in layers.items()}
    model_type = data.get("model_type")
    return (str(model_type) if model_type is not None else None), out


def _index(key: Any, what: str, path: str) -> int:
    try:
        value = int(key)
    except (TypeError, ValueError):
        value = -1
    require(value >= 0, "quantization_param_path", f"{path!r}: {what} {key!r} is not an integer >= 0")
    return value


def _scale(value: Any, rank: Any, layer: Any, path: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    require(ok, "quantization_param_path",
            f"{path!r}: the scale of rank {rank}, layer {layer} is {value!r}; scales must be finite numbers > 0")
    return float(value)


def resolve_kv_scales(args: Any, model_type: str | None, num_layers: int,
                      tp_size: int) -> tuple[tuple[float, ...], ...] | None:
    """--quantization-param-path's scales as [tp rank][layer] for this model, or None without the flag.
    ConfigError naming the flag when the file's model_type is another model's, or a rank or layer lacks."""
    path = args.quantization_param_path
    if path is None:
        return None
    file_type, factors = read_scales_file(path, args.kv_cache_dtype)
    require(file_type is None or model_type is None or file_type == model_type, "quantization_param_path",
            f"{path!r} holds scales for model_type {file_type!r}, but the model is {model_type!r}")
    require(sorted(factors) == list(range(tp_size)), "quantization_param_path",
            f"{path!r} holds scales for tensor-parallel ranks {sorted(factors)}; --tensor-parallel-size {tp_size} "
            f"needs ranks {list(range(tp_size))}")
    for rank, layers in sorted(factors.items()):
        missing = [i for i in range(num_layers) if i not in layers]
        extra = sorted(i for i in layers if i >= num_layers)
        require(not missing, "quantization_param_path",
                f"{path!r}: rank {rank} lacks the scales of layers {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} (the model has {num_layers} layers)")
        require(not extra, "quantization_param_path",
                f"{path!r}: rank {rank} has scales for layers {extra[:8]} the model does not have "
                f"({num_layers} layers)")
    return tuple(tuple(factors[rank][i] for i in range(num_layers)) for rank in range(tp_size))
