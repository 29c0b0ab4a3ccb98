"""Reading the Linear weights of a GGUF file in 4-bit form, under Hugging Face names, and its Q8_0 output
projection.

`GGUFLinearWeights(path)` memory-maps the file (index read by `gguf_file`) and knows, for each Linear
weight of a supported architecture, its Hugging Face name (`model.layers.3.self_attn.q_proj`) and
its GGML type. `int4_components(prefix)` decodes a Q4_0 / Q4_1 tensor into the int4 kernel's form
`(q uint8 [N, K], scale fp32 [N, K/32], zero fp32 [N, K/32])` with `w = (q - 8) * scale + zero`:
Q4_1 blocks (`d, m, 16 bytes of nibbles`: `w = d * q + m`) give `scale = d, zero = m + 8 d`; Q4_0
blocks (`d, 16 bytes`: `w = d * (q - 8)`) give `zero = 0`. In both, byte `j` of a block holds
element `j` in its low nibble and element `j + 16` in its high nibble.

`head_q8_components()` gives the output projection's Q8_0 blocks (`d, 32 int8`: `w = d * q`) as
`(codes int8 [vocab, hidden], scales fp32 [vocab, hidden/32])`: `output.weight`, else the token
embedding, which llama.cpp multiplies by when the file has no `output.weight` (a tied head).

llama.cpp stores the q and k projections of "llama" models with their rows permuted for its rotary
layout; transformers undoes that when it dequantizes (`LlamaTensorProcessor`), and so does this
reader, so rows are in Hugging Face order.
"""

from __future__ import annotations

import numpy as np
import torch

from aserve.model.quantization.gguf_file import GGUFTensorInfo, read_gguf_index

GGUF_GROUP_SIZE = 32
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_Q8_0_BLOCK_BYTES = 34
# GGUF tensor name inside a block -> Hugging Face module name inside `model.layers.N`.
_LINEAR_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


class GGUFLinearWeights:
    """The Linear weights of one GGUF file, by Hugging Face module name (see the module docstring).

    Raises ValueError for an architecture other than SUPPORTED_GGUF_ARCHITECTURES.
    """

    def __init__(self, path: str):
        self.path = path
        fields, tensors = read_gguf_index(path)
        self.architecture = str(fields.get("general.architecture", ""))
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"--quantization gguf: GGUF architecture {self.architecture!r} is not served natively "
                             f"(supported: {SUPPORTED_GGUF_ARCHITECTURES}); drop --quantization to serve it "
                             "dequantized")
        self.num_heads = int(fields[f"{self.architecture}.attention.head_count"])
        self.num_kv_heads = int(fields.get(f"{self.architecture}.attention.head_count_kv", self.num_heads))
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._tensors: dict[str, GGUFTensorInfo] = {}
        by_name = {tensor.name: tensor for tensor in tensors}
        self._head: GGUFTensorInfo | None = by_name.get("output.weight", by_name.get("token_embd.weight"))
        for tensor in tensors:
            prefix = _hf_prefix(tensor.name)
            if prefix is not None:
                self._tensors[prefix] = tensor

    def names(self) -> list[str]:
        """Hugging Face module names of the Linear weights in the file (`model.layers.0.mlp.up_proj`)."""
        return list(self._tensors)

    def quant_type(self, prefix: str) -> str | None:
        """The GGML type name ("Q4_1", "Q8_0", "F32", ...) of `prefix`'s weight; None if absent."""
        tensor = self._tensors.get(prefix)
        return None if tensor is None else tensor.type_name

    def shape(self, prefix: str) -> tuple[int, int]:
        """`(output_size, input_size)` of `prefix`'s weight."""
        k, n = self._tensors[prefix].dims  # GGUF lists the fastest-varying dim first
        return n, k

    def int4_components(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(q, scale, zero)` of a Q4_0/Q4_1 weight, rows in Hugging Face order (module docstring)."""
        tensor = self._tensors[prefix]
        kind = tensor.type_name
        if kind not in _BLOCK_BYTES:
            raise ValueError(f"{prefix}: GGUF type {kind} is not a 4-bit type {NATIVE_INT4_TYPES}")
        n, k = self.shape(prefix)
        num_groups, block_bytes = k // GGUF_GROUP_SIZE, _BLOCK_BYTES[kind]
        blocks = self._data[tensor.offset:tensor.offset + n * num_groups * block_bytes].reshape(n, num_groups,
                                                                                                 block_bytes)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, num_groups).astype(np.float32)
        if kind == "Q4_1":
            m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, num_groups).astype(np.float32)
            zero, nibbles = m + 8.0 * d, blocks[..., 4:]
        else:
            zero, nibbles = np.zeros_like(d), blocks[..., 2:]
        q = np.empty((n, num_groups, GGUF_GROUP_SIZE), dtype=np.uint8)
        np.bitwise_and(nibbles, 0x0F, out=q[..., :16])
        np.right_shift(nibbles, 4, out=q[..., 16:])
        q, d, zero = torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), torch.from_numpy(zero)
        heads = self._permuted_heads(prefix)
        if heads is not None:
            q, d, zero = (_reverse_permute_rows(t, heads) for t in (q, d, zero))
        return q.contiguous(), d.contiguous(), zero.contiguous()

    def head_q8_components(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(codes int8 [vocab, hidden], scales fp32 [vocab, hidden/32])` of the output projection when the
        file keeps it in Q8_0 (module docstring); None otherwise."""
        tensor = self._head
        if tensor is None or tensor.type_name != "Q8_0":
            return None
        k, n = tensor.dims
        groups = k // GGUF_GROUP_SIZE
        blocks = self._data[tensor.offset:tensor.offset + n * groups * _Q8_0_BLOCK_BYTES].reshape(
            n, groups, _Q8_0_BLOCK_BYTES)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, groups).astype(np.float32)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return torch.from_numpy(q), torch.from_numpy(d)

    def _permuted_heads(self, prefix: str) -> int | None:
        if self.architecture != "llama":
            return None
        if prefix.endswith("self_attn.q_proj"):
            return self.num_heads
        if prefix.endswith("self_attn.k_proj"):
            return self.num_kv_heads
        return None


def _hf_prefix(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in _LINEAR_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_LINEAR_NAMES[parts[2]]}"


def _reverse_permute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation (transformers' `_reverse_permute_weights`)."""
    half = t.shape[0] // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
