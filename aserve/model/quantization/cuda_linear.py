"""CUDA forms of the quantized-checkpoint Linear methods. Each method's `process_weights_after_loading`
asks `use_cuda_forms(device)` where its loaded weights live; on CUDA it takes the form below, elsewhere it
keeps its CPU form unchanged. Checked on CPU tensors (the Triton kernel under the interpreter, torch's
`_int_mm` / `_scaled_mm` on CPU) by `tests/model/quantization/test_cuda_linear.py`; not yet run on a GPU.

  gptq / awq / compressed-tensors pack-quantized (`checkpoint_int.py`), 4- and 8-bit: the canonical codes
      are packed into int32 words along K (`aserve/kernels/dequant_gemm.py`: `qweight [ceil(K/P), N]`),
      scales and zeros transposed to fp32 `[G, N]` (zeros dropped when every one is `2**(bits-1)`:
      symmetric), multiplied by the Triton dequant-GEMM. A group size that is not a multiple of 16 keeps
      the dequantized weight in the model dtype (`F.linear`, logged once).
  W8A8 int8 (`w8a8.py`): activations quantized per row as on CPU (`quantize_rows`), the integer product in
      `torch._int_mm` (cuBLASLt int8 x int8 -> int32) on the weight transposed once to a contiguous
      `[K, N]`; it needs K, N multiples of 8 and more than 16 rows (rows are padded with zeros to a multiple
      of 32: cuBLASLt refused 248 rows on an H200); other shapes, or a shape cuBLASLt refuses at run time
      (logged once), compute the integer product as an fp32 matmul of the codes (exact while |sums| < 2**24).
  FP8 (`fp8.py`, checkpoints and online): where the GPU's compute capability is >= 8.9 (read at load),
      with per-tensor / per-channel weight scales and K, N multiples of 16, activations are quantized to
      float8_e4m3fn per token (`amax / 448`) and multiplied in `torch._scaled_mm` (unit scales, fp32
      output), then scaled by the token and channel scales in fp32 (vLLM's per-token fallback form). Block
      scales, older GPUs and other shapes dequantize the weight per call (the CPU form).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from aserve.kernels.dequant_gemm import MIN_BLOCK_K, dequant_gemm, pack_codes
from aserve.model.quantization.base import register_weight

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)
_logged: set[str] = set()

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: fp8 tensor cores
INT_MM_MULTIPLE = 8  # torch._int_mm on CUDA: K, N multiples of 8 ...
# ... and more than 16 rows; cuBLASLt (CUDA 13, H200) also refused 248 rows (CUBLAS_STATUS_NOT_SUPPORTED),
# so rows are padded with zeros to a multiple of 32
INT_MM_ROW_MULTIPLE = 32
SCALED_MM_MULTIPLE = 16  # torch._scaled_mm: K, N multiples of 16


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def use_cuda_forms(device: torch.device | str) -> bool:
    """Whether weights on `device` take the CUDA forms (tests patch this to run them on CPU tensors)."""
    return torch.device(device).type == "cuda"


def fp8_scaled_mm_available(device: torch.device | str) -> bool:
    """Whether `device` multiplies fp8 in `torch._scaled_mm`: a CUDA GPU of compute capability >= 8.9."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


# ---- gptq / awq / compressed-tensors pack-quantized -----------------------------------------------------------
def pack_checkpoint_int(layer: Linear, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        bits: int, group_size: int) -> str | None:
    """Register the dequant-GEMM form (`dq_weight`, `dq_scales`, asymmetric: `dq_zeros`) of the canonical
    codes `[N, K]`, scales and zeros `[N, G]` on `layer`; or return why the kernel cannot take them."""
    if group_size != -1 and group_size % MIN_BLOCK_K:
        return f"group size {group_size} is not a multiple of the CUDA kernel's {MIN_BLOCK_K}"
    register_weight(layer, "dq_weight", pack_codes(codes, bits))
    register_weight(layer, "dq_scales", scales.float().t().contiguous())
    if not bool((zeros == 2 ** (bits - 1)).all()):
        register_weight(layer, "dq_zeros", zeros.float().t().contiguous())
    return None


def checkpoint_int_linear(layer: Linear, x: torch.Tensor, bits: int, group_size: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K]` times the weight `pack_checkpoint_int` registered (+ bias), in x's dtype."""
    lead = x.shape[:-1]
    y = dequant_gemm(x.reshape(-1, x.shape[-1]), layer.dq_weight, layer.dq_scales, getattr(layer, "dq_zeros", None),
                     bits, group_size, bias)
    return y.reshape(*lead, y.shape[-1])


# ---- W8A8 int8 -----------------------------------------------------------------------------------------------
def int_mm_fits(n: int, k: int) -> bool:
    """Whether a `[n, k]` int8 weight fits `torch._int_mm` on CUDA (K, N multiples of 8)."""
    return n % INT_MM_MULTIPLE == 0 and k % INT_MM_MULTIPLE == 0


def transpose_w8a8(layer: Linear) -> None:
    """Replace `layer.w8a8_weight [N, K]` by `w8a8_weight_kn [K, N]`, contiguous: cuBLASLt's int8 product
    wants a contiguous second operand (torchao: a transposed view silently gives wrong results)."""
    q = layer.w8a8_weight.data
    del layer._parameters["w8a8_weight"]
    register_weight(layer, "w8a8_weight_kn", q.t().contiguous())


def w8a8_linear_cuda(x: torch.Tensor, q_kn: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """`w8a8.w8a8_linear`'s semantics for the weight `q_kn [K, N]` (`transpose_w8a8`) with `torch._int_mm`'s
    CUDA limits met (module docstring)."""
    from aserve.model.quantization.w8a8 import quantize_rows

    lead = x.shape[:-1]
    k, n = q_kn.shape
    xq, a = quantize_rows(x.reshape(-1, k), input_scale)
    m = xq.shape[0]
    acc = None
    if int_mm_fits(n, k):
        padded = -(-m // INT_MM_ROW_MULTIPLE) * INT_MM_ROW_MULTIPLE
        if padded != m:
            xq = torch.cat([xq, xq.new_zeros(padded - m, k)])
        try:
            acc = torch._int_mm(xq, q_kn)[:m].float()
        except RuntimeError as exc:  # a cuBLASLt build that refuses this shape: same result, slower
            _log_once(f"int_mm:{padded}x{k}x{n}", "w8a8: torch._int_mm refused [%d, %d] x [%d, %d] (%s); "
                      "computing that product as an fp32 matmul of the codes", padded, k, k, n, exc)
            xq = xq[:m]
    if acc is None:
        acc = xq.float() @ q_kn.float()
    y = acc.mul_(a).mul_(w_scale)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*lead, n)


# ---- FP8 -----------------------------------------------------------------------------------------------------
def fp8_scaled_mm_fits(layer: Linear) -> str | None:
    """Why `layer`'s fp8 weight cannot take `torch._scaled_mm`, or None."""
    n, k = layer.fp8_weight.shape
    if layer.fp8_scale.shape[1] != 1:
        return "block scales"
    if n % SCALED_MM_MULTIPLE or k % SCALED_MM_MULTIPLE:
        return f"a [{n}, {k}] weight (K, N not multiples of {SCALED_MM_MULTIPLE})"
    return None


def choose_fp8_form(layer: Linear, what: str) -> None:
    """On CUDA, give `layer` the `_scaled_mm` form where it applies (`fp8_scaled_mm` set, module docstring);
    nothing elsewhere (the weight stays dequantized per call)."""
    device = layer.fp8_weight.device
    if not use_cuda_forms(device):
        return
    if not fp8_scaled_mm_available(device):
        _log_once(f"fp8-cap:{what}", "%s on %s: compute capability below %s, no fp8 torch._scaled_mm; the fp8 "
                  "weight is dequantized per call (F.linear)", what, device, FP8_MIN_CAPABILITY)
        return
    reason = fp8_scaled_mm_fits(layer)
    if reason is not None:
        _log_once(f"fp8-shape:{what}:{reason}", "%s: %s; such layers dequantize the fp8 weight per call (F.linear)",
                  what, reason)
        return
    layer.fp8_scaled_mm = True
    layer.register_buffer("fp8_row_scale", layer.fp8_scale.data.reshape(1, -1).float().contiguous(),
                          persistent=False)
    layer.register_buffer("fp8_unit", torch.ones((), dtype=torch.float32, device=device), persistent=False)
    _log_once(f"fp8-mm:{what}", "%s: fp8 activations per token x fp8 weights in torch._scaled_mm", what)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(xq float8_e4m3fn [M, K], a fp32 [M, 1])`: per-row scale `amax / 448` (1 for an all-zero row)."""
    xf = x.float()
    a = xf.abs().amax(dim=1, keepdim=True).div_(FP8_MAX)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return (xf / a).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), a


def fp8_scaled_linear(layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K]` times the fp8 weight with per-token fp8 activations in `torch._scaled_mm` (+ bias), x's dtype."""
    lead = x.shape[:-1]
    q = layer.fp8_weight
    xq, a = quantize_fp8_rows(x.reshape(-1, q.shape[1]))
    acc = torch._scaled_mm(xq, q.t(), scale_a=layer.fp8_unit, scale_b=layer.fp8_unit, out_dtype=torch.float32)
    y = acc.mul_(a).mul_(layer.fp8_row_scale)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*lead, q.shape[0])


def fp8_scaled_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_scaled_linear`'s semantics in plain torch: `q [N, K]` fp8, `scale [N, 1]`; fp64 product."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, a = quantize_fp8_rows(x2)
    y = (xq.double() @ q.double().t()).float() * a * scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def dequantized_fallback(what: str, reason: str, dtype: torch.dtype) -> None:
    """Log once that layers of `what` keep the dequantized weight on CUDA, and why."""
    _log_once(f"dq:{what}:{reason}", "--quantization %s on CUDA: %s; such layers keep the dequantized weight in %s "
              "(F.linear)", what, reason, dtype)
