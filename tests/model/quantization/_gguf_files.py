"""Test helper: small GGUF files written with the `gguf` package's own writer and quantizers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]], num_heads: int = 4,
               num_kv_heads: int = 2) -> Path:
    """Write `tensors` (name -> (fp32 array [N, K], GGML type name)) with the metadata a reader needs,
    plus a tokenizer-like string array (which index readers must skip)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", num_kv_heads)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_string("general.name", "tiny")
    for name, (array, kind) in tensors.items():
        qtype = GGMLQuantizationType[kind]
        data = array.astype(np.float32)
        if qtype != GGMLQuantizationType.F32:
            data = quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
