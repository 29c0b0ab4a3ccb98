"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import reference
from aserve.kernels.rms_norm import rms_norm as triton_rms_norm
from aserve.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """`forward(x)` -> normed; `forward(x, residual)` -> `(normed(x + residual), x + residual)`.

    Native: Hugging Face's order (normalize in fp32, round to x's dtype, then scale by the weight).
    CPU: for a bf16 model the C kernel (`cpu_ops.rms_norm`, the residual add and the norm in one call;
    x may be a projection's unrounded float32 output, and the sum it returns is float32, unrounded, so
    the residual stream stays float32 from layer to layer; the normed output is bf16), else torch's `F.rms_norm`; both fp32 inside with one rounding at the end:
    identical in fp32, within one bf16 rounding of the native form in bf16.
    """

    identity_weight = 1.0  # the `weight` that leaves normalized rows unscaled (dummy weights)
    weight_offset = 0.0  # the C kernel scales by (weight_offset + weight) in float32

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return reference.rms_norm(x, self.weight, self.eps, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = self.cpu_kernels
        if (kernels is not None and self.weight.dtype == torch.bfloat16 and kernels.accepts_rows(x)
                and (residual is None or kernels.accepts_rows(residual))):
            return kernels.rms_norm(x, self.weight, self.eps, residual, weight_offset=self.weight_offset)
        return self.forward_cpu_torch(x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel (`kernels/rms_norm.py`: the residual add and the norm in one pass, the
        native form's rounding order) when x, the residual and the weight share a dtype; else native."""
        if x.dtype == self.weight.dtype and (residual is None or residual.dtype == x.dtype):
            return triton_rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)

    def forward_cpu_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The CPU form when the C kernel does not apply."""
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        summed = x + residual
        return F.rms_norm(summed, self.weight.shape, self.weight, self.eps), summed

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, form={self.form}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `normalize(x) * (1 + weight)`, computed in float32 and rounded to x's dtype
    once (Llama rounds before scaling); the checkpoint stores `weight` zero-centred. Same call
    forms as `RMSNorm`: `forward(x)` or `forward(x, residual)` -> `(normed(x + residual), x + residual)`.
    CPU, in a bf16 model: the C kernel with a weight offset of 1 (the same float32 arithmetic, one
    rounding), which also takes float32 rows and keeps a float32 residual stream, as `RMSNorm`'s does."""

    identity_weight = 0.0  # the scale is (1 + weight): 0 leaves normalized rows unscaled (dummy weights)
    weight_offset = 1.0
    forward_cuda = None  # the Triton kernel scales by weight after rounding: Gemma's order is native only

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            summed = x + residual
            return self.forward_native(summed), summed
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(self.weight.dtype)

    def forward_cpu_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_native(x, residual)


class LayerNorm(CustomOp):
    """`torch.nn.LayerNorm` over the last dim, with `RMSNorm`'s call forms: `forward(x)` -> normed;
    `forward(x, residual)` -> `(normed(x + residual), x + residual)`. Without `elementwise_affine` it
    has no weight and no bias (OPT's `layer_norm_elementwise_affine=False`).

    In a model of lower precision than float32, x (or the residual) may be float32 rows (a projection's
    unrounded `float_output`, on CPU): the sum then stays float32, so the residual stream does too, and
    the normed output is computed in float32 and rounded once to the model's dtype. Otherwise this is
    `F.layer_norm` in x's dtype, as transformers computes it. One form on every device.
    """

    identity_weight = 1.0  # the `weight` that leaves normalized rows unscaled (dummy weights)

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.dtype = dtype or torch.get_default_dtype()
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            summed = x + residual
            return self._norm(summed), summed
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if x.dtype == self.dtype:
            return F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)
        # Float32 rows in a lower-precision model: norm in float32, one rounding.
        return F.layer_norm(x.float(), (self.hidden_size,), None if weight is None else weight.float(),
                            None if bias is None else bias.float(), self.eps).to(self.dtype)

    load_shard = RMSNorm.load_shard

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.weight is not None}"


NORM_LAYERS = (RMSNorm, GemmaRMSNorm, LayerNorm)  # the layers with an `identity_weight`
