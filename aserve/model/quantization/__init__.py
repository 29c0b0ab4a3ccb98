"""Quantization methods of `Linear` layers, one module per method (vLLM's `LinearMethodBase` hook).

  base.py         LinearMethodBase (create_weights / process_weights_after_loading / apply)
  unquantized.py  the float weight (every Linear's default)
  gguf.py         `--quantization gguf`: GGUF Q4_0/Q4_1 weights kept in 4 bits (CPU int4 kernel)
  int4.py         `--quantization int4`: weight-only group-32 int4, quantized at load (aserve extension)
  int8.py         `--quantization int8`: weight-only per-channel int8, quantized at load (aserve extension)
  int4_cpu.py     the int4 kernel's weight form, packing and matmul (shared by gguf, int4 and checkpoint_int)
  checkpoint_int.py      gptq / awq / compressed-tensors pack-quantized checkpoints: the Linear method (4-bit
                         kernel, 8-bit channel-wise on the int8 kernel, or dequantized)
  checkpoint_formats.py  reading their on-disk packings into that method's form (aserve/config/quantization.py parses the config)
  fp8.py          fp8 checkpoints (`quant_method: fp8`, compressed-tensors float-quantized) and online
                  `--quantization fp8`: float8_e4m3fn weights, dequantized per call (CPU, weight-only)
  w8a8.py         compressed-tensors int-quantized W8A8 checkpoints: int8 weights x per-row int8 activations
                  (`torch._int_mm`)
  cuda_linear.py  the CUDA forms of checkpoint_int / w8a8 / fp8, chosen at load on CUDA (Triton dequant-GEMM,
                  `torch._int_mm`, `torch._scaled_mm`); checked on CPU tensors, not yet run on a GPU
  bitsandbytes.py `--quantization bitsandbytes` (in-flight NF4) and bitsandbytes checkpoints (4-bit nf4 / fp4,
                  LLM.int8() on the int8 kernel), through the `bitsandbytes` package (imported only when used)
  gguf_file.py, gguf_reader.py   reading a GGUF file's index and its 4-bit Linear weights

The loader (`aserve/model/loader.py`) chooses a method per layer; model files never do.
"""

from __future__ import annotations

from aserve.model.quantization.base import LinearMethodBase
from aserve.model.quantization.int4 import Int4WeightOnlyMethod
from aserve.model.quantization.int8 import Int8WeightOnlyMethod

# Methods quantizing a float checkpoint at load time, by `--quantization` name.
_LOAD_TIME_METHODS: dict[str, type[LinearMethodBase]] = {"int4": Int4WeightOnlyMethod, "int8": Int8WeightOnlyMethod}


def load_time_method(name: str) -> LinearMethodBase:
    """The method for `--quantization int4|int8` (ValueError for other names)."""
    try:
        return _LOAD_TIME_METHODS[name]()
    except KeyError:
        raise ValueError(f"--quantization: {name!r} is not a load-time method ({sorted(_LOAD_TIME_METHODS)})") from None
