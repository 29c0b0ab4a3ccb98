"""bitsandbytes (`--quantization bitsandbytes`, `--load-format bitsandbytes`, checkpoint `quant_method:
bitsandbytes`), using the `bitsandbytes` package (imported only here, when used; without it: a
ConfigError naming `pip install bitsandbytes`).

In-flight (a float checkpoint with `--quantization bitsandbytes`, as vLLM): every Linear whose input size
is a multiple of 64, and the MoE experts' projections where theirs are, are quantized at load by
`bitsandbytes.functional.quantize_4bit` to NF4, blocks of 64 (bnb's defaults, no double quant); other
layers keep their float weight (logged).

Pre-quantized checkpoints (transformers + bitsandbytes `save_pretrained`):
  4-bit (`load_in_4bit`, nf4 / fp4, with or without double quant): per Linear `weight` uint8 (two codes a
      byte, the even element in the high nibble, over the row-major flattened weight) and its quant state
      `weight.absmax` / `.quant_map` / `.nested_absmax` / `.nested_quant_map` /
      `.quant_state.bitsandbytes__<nf4|fp4>` (a JSON blob), read with bnb's `QuantState.from_dict`.
  8-bit (`load_in_8bit`, LLM.int8()): `weight` int8 `[N, K]` and `SCB` fp32 `[N]` (each row's absmax), i.e.
      `w = weight * SCB / 127`: served on aserve's int8 weight-only kernel (`int8.int8_linear`,
      `_weight_int8pack_mm`) with per-row scales `SCB / 127`; the outlier threshold (activation columns
      above `llm_int8_threshold` multiplied in fp16) is ignored: activations are never quantized here.

Form loaded into a 4-bit layer (output dim first, so fused layers stack their shards' rows):
  `bnb_packed` uint8 `[N, K / 2]`   the codes, bnb's byte order (row n's bytes are the flat weight's)
  `bnb_absmax` fp32  `[N, K / 64]`  each 64-weight block's absmax (double quant undone at load by bnb)
  `bnb_code`   fp32  `[16]`         the code book (the checkpoint's `quant_map`: bnb's NF4 or FP4 table)
  `w[n, k] = code[q[n, k]] * absmax[n, k // 64]`.
With K a multiple of 64 every block lies in one row, so the flat per-tensor blocks are per-row blocks:
fused q|k|v and gate|up layers keep each checkpoint shard's own quant state (its rows' absmax); only the
double quantization of absmax is expanded to fp32 (4.5 bits a weight resident instead of ~4.13); nothing
is requantized. Shards must share one code book (one checkpoint `quant_type`). A quantized module whose
layer's K is not a multiple of 64 is loaded dequantized (by bnb's `dequantize_4bit`) into a float weight,
logged; so are quantized MoE experts (aserve's expert layers take no pre-quantized tensors).

Kernel (CPU; numbers in the README, `benchmarks/bnb_cpu.py`): after loading, each layer holds bnb's
`QuantState` of that form (`layer.bnb_state`) and multiplies with `bitsandbytes.matmul_4bit`:
  fp32 models (and bf16 ones where the fused kernel does not run): bnb's C kernel dequantizes the weight
      to the activation dtype per call, then `F.linear` (fp32: exactly the dequantized weight's product);
  bf16 models on a CPU with AVX512-BF16 and N % 32 == 0: bnb's CPU re-packing (`_convert_weight_packed_
      for_cpu`, what `bnb.nn.Linear4bit` does in eval mode) and its fused 4-bit GEMM (absmax in bf16).
`--device cuda` is refused for bitsandbytes at start-up.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from aserve.config.errors import ConfigError
from aserve.model.quantization.base import LinearMethodBase, drop_weights, register_weight
from aserve.model.quantization.int8 import int8_linear
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from torch import nn

    from aserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)

BLOCKSIZE = 64  # bnb's default 4-bit blocksize (transformers and vLLM use it)
INSTALL = "pip install bitsandbytes"
KERNEL = ("bnb.matmul_4bit: the weight dequantized per call by bnb's CPU kernel (cdequantize_blockwise_cpu_*) to the "
          "activation dtype + F.linear (weight-only; exact to the dequantized weight in fp32)")
KERNEL_FUSED = ("bnb.matmul_4bit on bnb's CPU re-packing: the fused AVX512-BF16 4-bit GEMM (gemv_4bit_inference_cpu_*; "
                "bf16 activations, absmax rounded to bf16)")
_STATE_RE = re.compile(r"^(?P<prefix>.+)\.weight\.(?P<key>absmax|quant_map|nested_absmax|nested_quant_map|"
                       r"quant_state\.bitsandbytes__(?:nf4|fp4))$")
_logged: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def bnb_functional():
    """`bitsandbytes.functional` (ConfigError naming `pip install bitsandbytes` when it is missing)."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as exc:
        raise ConfigError(f"--quantization bitsandbytes: needs the bitsandbytes package ({INSTALL}); "
                          f"importing it failed: {exc}") from None
    return bnbf


# ---- the 4-bit form and its kernel -----------------------------------------------------------------------
def _fused_cpu_kernel(layer) -> bool:
    """Whether `layer` goes to bnb's fused AVX512-BF16 CPU kernel: a bf16 model on a CPU with AVX512-BF16,
    N a multiple of the kernel's 32-row tiles, and this bnb has the CPU re-packing (0.50 has)."""
    bnbf = bnb_functional()
    return (layer.params_dtype == torch.bfloat16 and layer.output_size % 32 == 0
            and hasattr(bnbf, "_convert_weight_packed_for_cpu") and bool(bnbf.has_avx512bf16()))


def _finalize(layer, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> None:
    """Register the 4-bit form on `layer` and bnb's `QuantState` of it (`layer.bnb_state`), re-packed for the
    fused CPU kernel where it runs (`_fused_cpu_kernel`)."""
    bnbf = bnb_functional()
    n, k = layer.output_size, layer.input_size
    code = code.float().contiguous()
    quant_type = "fp4" if float(code[1]) > 0 else "nf4"  # bnb's own test (its CPU kernels hard-code the tables)
    if not torch.allclose(code, bnbf.get_4bit_type(quant_type, device="cpu").float(), rtol=0, atol=1e-6):
        raise ValueError(f"bitsandbytes: a quant_map that is neither bnb's nf4 nor fp4 table ({code.tolist()[:4]}...) "
                         "is not implemented")
    state = bnbf.QuantState(absmax=absmax.float().reshape(-1).contiguous(), shape=torch.Size([n, k]), code=code,
                            blocksize=BLOCKSIZE, quant_type=quant_type, dtype=layer.params_dtype)
    packed = packed.reshape(n, k // 2).contiguous()  # bnb reads it flat (matmul_4bit views it [-1, 1])
    fused = _fused_cpu_kernel(layer)
    if fused:
        packed, state = bnbf._convert_weight_packed_for_cpu(packed, state)
    drop_weights(layer, keep=("bias",))
    register_weight(layer, "bnb_packed", packed)  # 4 bits a weight
    register_weight(layer, "bnb_absmax", state.absmax)  # fp32 [N * K / 64] (fused kernel: bf16 [K / 64, N])
    layer.bnb_state = state
    _log_once(f"kernel:{fused}:{quant_type}", "bitsandbytes %s: %s", quant_type, KERNEL_FUSED if fused else KERNEL)


def _apply_4bit(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    import bitsandbytes

    return bitsandbytes.matmul_4bit(x, layer.bnb_packed, quant_state=layer.bnb_state, bias=bias)


def quantize_nf4(weight: torch.Tensor, quant_type: str = "nf4") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bnb's `quantize_4bit` of `weight [N, K]` (K % 64 == 0), blocks of 64, no double quant: `(packed
    uint8 [N, K/2], absmax fp32 [N, K/64], code fp32 [16])`."""
    n, k = weight.shape
    packed, state = bnb_functional().quantize_4bit(weight.detach().float().contiguous(), blocksize=BLOCKSIZE,
                                                   compress_statistics=False, quant_type=quant_type)
    return packed.reshape(n, k // 2), state.absmax.float().reshape(n, k // BLOCKSIZE), state.code.float()


class BnbInFlightMethod(UnquantizedLinearMethod):
    """`--quantization bitsandbytes` of a float checkpoint: loads the float `weight`, then keeps it as NF4."""

    name = "bitsandbytes"

    def process_weights_after_loading(self, layer: Linear) -> None:
        _finalize(layer, *quantize_nf4(layer.weight.data))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _apply_4bit(layer, x, bias)


class Bnb4bitCheckpointMethod(LinearMethodBase):
    """4-bit weights read from a bitsandbytes checkpoint (`bnb_packed`, `bnb_absmax`; the reader sets the
    code book `bnb_code` on the layer)."""

    name = "bitsandbytes"

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        n, k = layer.output_size, layer.input_size
        register_weight(layer, "bnb_packed", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        register_weight(layer, "bnb_absmax", torch.empty(n, k // BLOCKSIZE, dtype=torch.float32, device=device))

    def process_weights_after_loading(self, layer: Linear) -> None:
        code = getattr(layer, "bnb_code", None)
        if code is None:
            raise ValueError("bitsandbytes checkpoint: a 4-bit layer got no quant_map")
        _finalize(layer, layer.bnb_packed.data, layer.bnb_absmax.data, code)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _apply_4bit(layer, x, bias)


class Bnb8bitCheckpointMethod(LinearMethodBase):
    """LLM.int8() weights: int8 `weight` with per-row `SCB` (absmax), on the int8 weight-only kernel."""

    name = "bitsandbytes"

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        register_weight(layer, "int8_weight", torch.empty(layer.output_size, layer.input_size, dtype=torch.int8,
                                                          device=device))
        register_weight(layer, "int8_scales", torch.empty(layer.output_size, dtype=torch.float32, device=device))

    def process_weights_after_loading(self, layer: Linear) -> None:
        register_weight(layer, "int8_scales", layer.int8_scales.data.to(layer.params_dtype))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.int8_weight, layer.int8_scales, bias)


# ---- in-flight assignment ---------------------------------------------------------------------------------
def set_inflight_methods(model: nn.Module) -> int:
    """Give the in-flight NF4 method to every Linear (and MoE expert projections) whose input size is a
    multiple of 64, but MoE routers (`gate`, `shared_expert_gate`: float, as vLLM keeps them); returns how
    many Linear layers took it (logged, with those that stay float)."""
    from aserve.model.quantization.assign import expert_layers, linear_layers

    bnb_functional()  # fail before loading any weight when the package is missing
    method = BnbInFlightMethod()
    layers = linear_layers(model)
    taken = {name for name, layer in layers
             if layer.input_size % BLOCKSIZE == 0 and name.rsplit(".", 1)[-1] not in ("gate", "shared_expert_gate")}
    for name, layer in layers:
        if name in taken:
            layer.set_quant_method(method)
    experts = [moe for _, moe in expert_layers(model)
               if moe.hidden_size % BLOCKSIZE == 0 and moe.intermediate_size % BLOCKSIZE == 0]
    for moe in experts:
        moe.set_quant_method(method)
    logger.info("--quantization bitsandbytes: %d of %d Linear layers and %d of %d MoE expert layers quantized "
                "to NF4 (blocks of %d) at load by bitsandbytes%s", len(taken), len(layers),
                len(experts), len(expert_layers(model)), BLOCKSIZE,
                "" if len(taken) == len(layers) else " (the others stay float: MoE routers, or K not a multiple of 64)")
    return len(taken)


# ---- reading pre-quantized checkpoints --------------------------------------------------------------------
def quantized_prefixes(names: Iterable[str], bits: int) -> set[str]:
    """The module names a bitsandbytes checkpoint stores quantized: 4-bit those with a
    `weight.quant_state.bitsandbytes__*` blob, 8-bit those with an `SCB`."""
    out = set()
    for name in names:
        if bits == 8:
            if name.endswith(".SCB"):
                out.add(name[: -len(".SCB")])
            continue
        m = _STATE_RE.match(name)
        if m and m["key"].startswith("quant_state."):
            out.add(m["prefix"])
    return out


def assign_checkpoint_methods(model: nn.Module, bits: int, prefixes: set[str]
                              ) -> tuple[dict[str, tuple[Linear, int | None]], set[str]]:
    """Give the checkpoint method to the Linear layers fed only by quantized modules (4-bit: and whose
    input size is a multiple of 64); returns ({prefix: (layer, shard)}, the quantized prefixes to load
    dequantized into float weights: other shapes, MoE experts)."""
    from aserve.model.quantization.assign import checkpoint_prefixes, linear_layers, set_checkpoint_method

    native = set()
    for name, layer in linear_layers(model):
        if bits == 8 or layer.input_size % BLOCKSIZE == 0:
            native.update(p for p in checkpoint_prefixes(model, name) if p in prefixes)
    method = Bnb8bitCheckpointMethod() if bits == 8 else Bnb4bitCheckpointMethod()
    targets = set_checkpoint_method(model, method, native, "bitsandbytes checkpoint")
    rest = prefixes - native
    if rest:
        _log_once(f"deq{bits}", "bitsandbytes checkpoint: %d quantized modules (e.g. %s) are loaded dequantized "
                  "(input size not a multiple of %d, or MoE experts)", len(rest), min(rest), BLOCKSIZE)
    return targets, rest


def _quant_state(prefix: str, parts: dict[str, torch.Tensor]):
    """bnb's `QuantState` of one module's 4-bit tensors (keys relative to `<prefix>.weight.`)."""
    bnbf = bnb_functional()
    try:
        return bnbf.QuantState.from_dict(qs_dict=dict(parts), device=torch.device("cpu"))
    except (ValueError, KeyError, AssertionError, json.JSONDecodeError) as exc:
        raise ValueError(f"bitsandbytes checkpoint: {prefix}: unreadable quant state ({exc})") from None


def _absmax(state) -> torch.Tensor:
    """The fp32 per-block absmax of `state` (double quant undone by bnb's `dequantize_blockwise`)."""
    if state.nested:
        return bnb_functional().dequantize_blockwise(state.absmax, state.state2).float() + state.offset
    return state.absmax.float()


def dequantize_4bit_module(prefix: str, weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight of one 4-bit checkpoint module, by bnb's `dequantize_4bit`."""
    state = _quant_state(prefix, parts)
    return bnb_functional().dequantize_4bit(weight, state).float().reshape(state.shape)


def _canonical_4bit(prefix: str, weight: torch.Tensor, parts: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = _quant_state(prefix, parts)
    n, k = state.shape
    if state.blocksize != BLOCKSIZE:
        raise ValueError(f"bitsandbytes checkpoint: {prefix}: blocksize {state.blocksize} is not implemented "
                         f"(built: {BLOCKSIZE})")
    if weight.dtype != torch.uint8 or weight.numel() * 2 != n * k:
        raise ValueError(f"bitsandbytes checkpoint: {prefix}: weight {tuple(weight.shape)} {weight.dtype} does "
                         f"not hold the 4-bit codes of a [{n}, {k}] weight (bnb_4bit_quant_storage uint8)")
    absmax = _absmax(state)
    if absmax.numel() != n * k // BLOCKSIZE:
        raise ValueError(f"bitsandbytes checkpoint: {prefix}: absmax has {absmax.numel()} blocks, expected "
                         f"{n * k // BLOCKSIZE}")
    return weight.reshape(n, k // 2), absmax.reshape(n, k // BLOCKSIZE), state.code.float()


def checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], bits: int,
                       targets: dict[str, tuple[Linear, int | None]], dequantized: set[str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each quantized module's tensors replaced by the method's (`<m>.bnb_packed` /
    `.bnb_absmax`, or `<m>.int8_weight` / `.int8_scales`), or by its dequantized `<m>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    quantized = targets.keys() | dequantized
    for name, tensor in weights:
        prefix, key = _split(name, bits)
        if prefix not in quantized:
            yield name, tensor
            continue
        if key is None:  # bias, 8-bit `weight_format`
            if not name.endswith(".weight_format"):
                yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[key] = tensor
        if not _complete(parts, bits):
            continue
        del pending[prefix]
        yield from _emit(prefix, parts, bits, targets)
    if pending:
        raise ValueError(f"bitsandbytes checkpoint: {sorted(pending)[:4]} lack a weight or its quant state")


def _split(name: str, bits: int) -> tuple[str, str | None]:
    """(module prefix, which part: "weight" | "SCB" | a quant-state key | None for other tensors)."""
    if bits == 4:
        m = _STATE_RE.match(name)
        if m:
            return m["prefix"], m["key"]
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix if suffix in ("weight", "SCB") else None


def _complete(parts: dict[str, torch.Tensor], bits: int) -> bool:
    if bits == 8:
        return "weight" in parts and "SCB" in parts
    blob = next((k for k in parts if k.startswith("quant_state.")), None)
    if blob is None or "weight" not in parts or not {"absmax", "quant_map"} <= parts.keys():
        return False
    nested = "nested_blocksize" in json.loads(bytes(parts[blob].to(torch.uint8).tolist()).decode())
    return not nested or {"nested_absmax", "nested_quant_map"} <= parts.keys()


def _emit(prefix: str, parts: dict[str, torch.Tensor], bits: int,
          targets: dict[str, tuple[Linear, int | None]]) -> Iterator[tuple[str, torch.Tensor]]:
    weight = parts.pop("weight")
    if bits == 8:
        scb = parts["SCB"].float()
        if weight.dtype != torch.int8 or weight.dim() != 2 or scb.shape != (weight.shape[0],):
            raise ValueError(f"bitsandbytes checkpoint: {prefix}: 8-bit weight {tuple(weight.shape)} "
                             f"{weight.dtype} with SCB {tuple(scb.shape)} is not LLM.int8()'s form")
        if prefix not in targets:
            yield f"{prefix}.weight", weight.float() * (scb / 127.0).unsqueeze(1)
            return
        yield f"{prefix}.int8_weight", weight
        yield f"{prefix}.int8_scales", scb / 127.0
        return
    if prefix not in targets:
        yield f"{prefix}.weight", dequantize_4bit_module(prefix, weight, parts)
        return
    packed, absmax, code = _canonical_4bit(prefix, weight, parts)
    layer, _ = targets[prefix]
    current = getattr(layer, "bnb_code", None)
    if current is not None and not torch.equal(current, code):
        raise ValueError(f"bitsandbytes checkpoint: {prefix}: its quant_map differs from the modules fused with "
                         "it (mixed nf4 / fp4); not implemented")
    layer.register_buffer("bnb_code", code, persistent=False)
    yield f"{prefix}.bnb_packed", packed
    yield f"{prefix}.bnb_absmax", absmax
