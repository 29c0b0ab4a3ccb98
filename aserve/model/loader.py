"""Build a model from an `AserveConfig` and fill its weights (safetensors, PyTorch .bin/.pt, or dummy).

`config.model.model_path` is already a local Hugging Face folder (see `aserve.model_source`).
The loader also gives the model's Linear layers their quantization methods (`--quantization`):
`gguf` keeps a GGUF file's Q4_0/Q4_1 weights in 4 bits (read from the file the folder was converted
from); `int4` / `int8` quantize a float checkpoint after loading it; a quantized checkpoint's
`QuantSpec.method` picks its reader (fp8, w8a8, or gptq / awq / compressed-tensors pack-quantized).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from aserve.config import AserveConfig
from aserve.config.parallel import kv_head_replicas, rank_arch_config, stage_arch_config
from aserve.config.quantization import CUDA_METHODS
from aserve.distributed.context import SINGLE, ParallelContext
from aserve.model.attention.base import AttentionBackend
from aserve.model.layers.greedy_head import MAX_ROWS as GREEDY_MAX_ROWS
from aserve.model.layers.norm import NORM_LAYERS
from aserve.model.models.registry import get_model_class
from aserve.model.pipeline import stage_local_name
from aserve.model.quantization import assign, load_time_method
from aserve.model.tensor_parallel import apply_tensor_parallel

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_DUMMY_RANGE = 1e-3


class WeightsNotFoundError(FileNotFoundError):
    """The model folder holds no weight files of the requested format."""


def torch_dtype(name: str) -> torch.dtype:
    """"float32" | "float16" | "bfloat16" -> the torch dtype (ValueError otherwise)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype: expected one of {sorted(_TORCH_DTYPES)}, got {name!r}") from None


def kv_cache_dtype_for(config: AserveConfig) -> torch.dtype:
    """The KV cache's storage dtype: "auto" -> the model dtype; "fp8"/"fp8_e4m3"/"fp8_e5m2" -> fp8."""
    kind = config.cache.kv_cache_dtype
    if kind == "auto":
        return torch_dtype(config.model.dtype)
    try:
        return _KV_CACHE_DTYPES[kind]
    except KeyError:
        raise ValueError(f"--kv-cache-dtype: unsupported value {kind!r}") from None


def load_model(config: AserveConfig, backend: AttentionBackend, device: torch.device | str,
               parallel: ParallelContext = SINGLE) -> nn.Module:
    """Construct the architecture's model on `device` in `config.model.dtype` and load its weights;
    under tensor parallelism (`parallel`), this rank's slice of it (built from the rank's `ArchConfig`,
    sharded as the model's declared plan says: aserve/model/tensor_parallel.py); in a pipeline stage,
    only the stage's layers (the runner turns it into the stage: runner/pipeline_stage.py).

    Raises WeightsNotFoundError when the folder has no weights of the requested load format and
    ValueError when the checkpoint does not fit the architecture or the quantization.
    `--model-impl transformers` builds transformers' own model instead (transformers_loading.py).
    """
    if config.model.model_impl == "transformers":
        if parallel.is_parallel:  # refused at start-up (check_transformers_args); inner layers trust that
            raise ValueError("the Transformers backend cannot be split across tensor-parallel ranks")
        from aserve.model.models.transformers_loading import load_transformers_model

        model = load_transformers_model(config, backend, device)
        settle_kv_scales(model, config, parallel)
        return model
    arch = stage_arch_config(rank_arch_config(config.model.arch, parallel.tp_size), parallel.pp_rank, parallel.pp_size)
    dtype = torch_dtype(config.model.dtype)
    model_cls = get_model_class(arch.architecture)
    model = model_cls(arch, backend, dtype, device)
    apply_tensor_parallel(model, parallel, kv_head_replicas(config.model.arch.num_key_value_heads, parallel.tp_size))
    load_format = config.load.load_format
    quantization = config.load.quantization
    kind = torch.device(device).type
    if quantization is not None and kind != "cpu" and not (kind == "cuda" and quantization in CUDA_METHODS):
        raise ValueError(f"--quantization {quantization}: implemented for CPU only on {kind} (use --device cpu; "
                         f"CUDA serves {', '.join(CUDA_METHODS)})")
    options = config.load.options
    threads = options.num_threads if options.multithread_load else 1  # --model-loader-extra-config
    if quantization == "gguf" or config.load.quant_spec is not None:  # a GGUF file, a quantized checkpoint
        from aserve.model.checkpoint_readers import quantized_weights

        model.load_weights(quantized_weights(model, config, threads))
    else:
        if quantization == "fp8":  # online FP8: Linear layers only (MoE experts stay in the model dtype)
            from aserve.model.quantization.fp8 import Fp8OnlineMethod

            method = Fp8OnlineMethod()
            layers = assign.linear_layers(model)
            for _, layer in layers:
                layer.set_quant_method(method)
            logger.info("--quantization fp8: %d Linear layers quantized to float8_e4m3fn at load (per-channel "
                        "scales)%s", len(layers), "; MoE experts stay unquantized" if assign.expert_layers(model) else "")
        elif quantization == "bitsandbytes":  # in-flight NF4 (aserve/model/quantization/bitsandbytes.py logs it)
            from aserve.model.quantization.bitsandbytes import set_inflight_methods

            set_inflight_methods(model)
        elif quantization is not None:
            num = assign.set_load_time_method(model, load_time_method(quantization))
            logger.info("--quantization %s: %d of %d Linear layers quantized at load", quantization, num,
                        len(assign.linear_layers(model)))
        if load_format == "dummy":
            init_dummy_weights(model, config.model.seed)
        elif load_format == "npcache":
            from aserve.model.npcache import npcache_weights

            model.load_weights(npcache_weights(config.model.model_path, config.load.ignore_patterns))
        elif load_format == "tensorizer":
            from aserve.model.tensorizer_io import tensorizer_weights

            model.load_weights(tensorizer_weights(config.load.options))
        else:
            other_stages = (None if not arch.total_layers  # a pipeline stage skips the other stages' layers
                            else lambda name: stage_local_name(name, arch) is None)
            model.load_weights(iterate_weights(config.model.model_path, load_format, skip=other_stages,
                                               ignore_patterns=config.load.ignore_patterns, num_threads=threads))
    assign.use_cpu_linear_forms(model)
    if quantization == "gguf":
        from aserve.model.checkpoint_readers import use_gguf_q8_head

        use_gguf_q8_head(model, config.model.model_path)
    screen = getattr(getattr(model, "lm_head", None), "greedy_screen", None)
    if screen is not None:
        logger.info("LM head: greedy steps of up to %d rows screened on an 8-bit copy of it (%.0f MB)",
                    GREEDY_MAX_ROWS, screen.nbytes / 1e6)
    counts = assign.process_weights_after_loading(model)
    if quantization is not None or counts.keys() - {"unquantized"}:
        logger.info("Linear methods: %s; activations %s (CPU capability %s)",
                    ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())), config.model.dtype,
                    torch.backends.cpu.get_cpu_capability())
    settle_kv_scales(model, config, parallel)
    return model.eval()


def settle_kv_scales(model: nn.Module, config: AserveConfig, parallel: ParallelContext = SINGLE) -> None:
    """fp8 KV caches: each attention layer's scales from the checkpoint (set by load_weights), the
    --quantization-param-path file (this rank's) or --calculate-kv-scales; 1.0 otherwise (aserve/model/kv_scales.py)."""
    from aserve.model.kv_scales import apply_kv_scales

    file_scales = config.cache.kv_scales
    scales = None if file_scales is None else file_scales[parallel.tp_rank]
    arch = getattr(model, "arch", None)
    if scales is not None and arch is not None and arch.total_layers:  # a pipeline stage: its layers' scales
        scales = scales[arch.first_layer:arch.first_layer + arch.num_hidden_layers]
    apply_kv_scales(model, kv_cache_dtype_for(config), scales, config.cache.calculate_kv_scales,
                    what=config.model.model_path)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter with uniform noise in [-1e-3, 1e-3], norm weights around their layer's
    `identity_weight` (1 for RMSNorm / LayerNorm, 0 for Gemma's `1 + w`), reproducibly on a given device.
    The noise is drawn where the parameter lives, by one generator per device seeded with `seed` (an
    8B model's billions of draws on a GPU take a fraction of a second; on the host they took a minute)."""
    generators: dict[torch.device, torch.Generator] = {}
    modules = dict(model.named_modules())
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        noise = torch.rand(param.shape, generator=generators[device], dtype=torch.float32, device=device)
        noise.mul_(2 * _DUMMY_RANGE).sub_(_DUMMY_RANGE)
        owner, leaf = name.rsplit(".", 1)
        module = modules[owner]
        if leaf == "weight" and isinstance(module, NORM_LAYERS):
            noise += module.identity_weight
        param.data.copy_(noise)


def weight_files(model_path: str, load_format: str,
                 ignore_patterns: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """("safetensors" | "pt", sorted weight files) for `load_format` in auto/safetensors/pt/gguf.

    "gguf" means a folder converted from a GGUF file, which holds safetensors. An index file
    (`*.index.json`), when present, selects the files it names. Files whose path inside the folder
    matches one of `ignore_patterns` (fnmatch globs, --ignore-patterns) are skipped.
    """
    if ignore_patterns:
        kind, files = weight_files(model_path, load_format)
        kept = [f for f in files
                if not any(fnmatch.fnmatch(os.path.relpath(f, model_path), p) for p in ignore_patterns)]
        if not kept:
            raise WeightsNotFoundError(f"--ignore-patterns {list(ignore_patterns)}: every weight file of "
                                       f"{model_path} matches ({[os.path.basename(f) for f in files]})")
        return kind, kept
    if load_format == "npcache":  # its source files are found as auto's
        load_format = "auto"
    if load_format in ("auto", "safetensors", "gguf"):
        files = _select_files(model_path, ["*.safetensors"], "model.safetensors.index.json")
        if files:
            return "safetensors", files
        if load_format != "auto":
            raise WeightsNotFoundError(f"--load-format {load_format}: no *.safetensors files in {model_path}")
    if load_format in ("auto", "pt"):
        files = _select_files(model_path, ["*.bin", "*.pt"], "pytorch_model.bin.index.json")
        files = [f for f in files if not os.path.basename(f).startswith(("training_args", "optimizer", "scheduler"))]
        if files:
            return "pt", files
        raise WeightsNotFoundError(f"no weight files (*.safetensors, *.bin, *.pt) in {model_path}")
    raise ValueError(f"--load-format: unsupported value {load_format!r}")


def _select_files(folder: str, patterns: list[str], index_name: str) -> list[str]:
    files = sorted({f for p in patterns for f in glob.glob(os.path.join(folder, p))})
    index = os.path.join(folder, index_name)
    if files and os.path.isfile(index):
        with open(index) as f:
            named = set(json.load(f).get("weight_map", {}).values())
        files = [f for f in files if os.path.basename(f) in named]
    return files


def iterate_weights(model_path: str, load_format: str, skip: Callable[[str], bool] | None = None,
                    ignore_patterns: tuple[str, ...] = (), num_threads: int = 1
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, CPU tensor) for every tensor in the folder's weight files (but those
    matching `ignore_patterns`), except those `skip(name)` is true for (safetensors files do not even
    read those). With `num_threads` > 1 and several files, the files are read on that many threads
    (`--model-loader-extra-config '{"enable_multithread_load": true}'`), yielded in file order."""
    kind, files = weight_files(model_path, load_format, ignore_patterns)
    if num_threads > 1 and len(files) > 1:
        yield from _read_files_threaded(kind, files, skip, num_threads)
        return
    if kind == "safetensors":
        from safetensors import safe_open

        handles = [safe_open(path, framework="pt", device="cpu") for path in files]
        names = [(h, name) for h in handles for name in h.keys()  # noqa: SIM118 (not a mapping)
                 if skip is None or not skip(name)]
        for h, name in tqdm(names, desc="Loading weights", unit="tensor", mininterval=0.5):
            yield name, h.get_tensor(name)
        return
    for path in tqdm(files, desc="Loading weights", unit="file"):
        state = _load_state_dict(path)
        yield from ((k, v) for k, v in state.items() if skip is None or not skip(k))
        del state


def _load_state_dict(path: str) -> dict:
    """A PyTorch weight file's state dict, memory-mapped where the file allows it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) checkpoints cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    return state


def _read_file(kind: str, path: str, skip: Callable[[str], bool] | None) -> list[tuple[str, torch.Tensor]]:
    if kind == "safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as h:
            return [(n, h.get_tensor(n)) for n in h.keys() if skip is None or not skip(n)]  # noqa: SIM118
    return [(k, v) for k, v in _load_state_dict(path).items() if skip is None or not skip(k)]


def _read_files_threaded(kind: str, files: list[str], skip: Callable[[str], bool] | None,
                         num_threads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every file read on a pool of `num_threads` threads (at most `num_threads` files in memory ahead)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="aserve-load") as pool:
        pending = [pool.submit(_read_file, kind, path, skip) for path in files[:num_threads]]
        for i in tqdm(range(len(files)), desc="Loading weights", unit="file"):
            tensors = pending[i].result()
            if i + num_threads < len(files):
                pending.append(pool.submit(_read_file, kind, files[i + num_threads], skip))
            yield from tensors
