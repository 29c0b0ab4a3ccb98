"""A minimal GGUF index reader: the scalar metadata and where each tensor lies, in milliseconds.

`gguf.GGUFReader` builds numpy views of every metadata item, which takes seconds for a tokenizer's
vocabulary; serving needs only a few scalars and the tensor table. Format (GGUF v2/v3, little
endian): magic `GGUF`, version u32, tensor count u64, metadata count u64; metadata entries
`(key: string, type: u32, value)`; tensor infos `(name: string, n_dims: u32, dims: u64 * n_dims,
type: u32, offset: u64)`; tensor data starts at the next multiple of `general.alignment` (32) and
each offset is relative to it. Strings are a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

# Metadata value types: fixed-size ones by struct code; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# The GGML types this project reads or names (ggml.h `enum ggml_type`).
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # fastest-varying first, as GGUF stores them
    type_name: str  # "Q4_1", "F32", ... ("type<N>" for types not in GGML_TYPE_NAMES)
    offset: int  # absolute byte offset of the tensor's data in the file


def read_gguf_index(path: str) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """`(scalar metadata by key, tensor infos)` of the GGUF file `path`; array-valued metadata is left
    out. Raises ValueError if the file is not GGUF v2/v3."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Parser(buf).parse(path)


class _Parser:
    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.pos = 0

    def parse(self, path: str) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        self.pos = 4
        version = self._read("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = self._read("Q"), self._read("Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            value = self._value(self._read("I"))
            if value is not None:
                fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._read("Q") for _ in range(self._read("I")))
            kind = self._read("I")
            infos.append((name, dims, GGML_TYPE_NAMES.get(kind, f"type{kind}"), self._read("Q")))
        alignment = int(fields.get("general.alignment", 32))
        data_start = -(-self.pos // alignment) * alignment
        return fields, [GGUFTensorInfo(n, d, t, data_start + off) for n, d, t, off in infos]

    def _read(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def _string(self) -> str:
        n = self._read("Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        """Read one value; arrays are skipped (None)."""
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._read("I"), self._read("Q")
            if item in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self._value(item)
            return None
        raise ValueError(f"unknown GGUF metadata type {kind} at byte {self.pos}")
