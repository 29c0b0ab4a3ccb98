import numpy as np
import pytest
from gguf import GGUFReader

from aserve.model.quantization.gguf_file import read_gguf_index
from tests.model.quantization._gguf_files import write_gguf


def test_index_matches_the_gguf_package_reader(tmp_path):
    rng = np.random.default_rng(0)
    path = write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.attn_q.weight": (rng.standard_normal((32, 64)), "Q4_1"),
        "blk.0.attn_norm.weight": (rng.standard_normal(64), "F32"),
        "blk.0.ffn_up.weight": (rng.standard_normal((48, 96)), "Q8_0"),
        "blk.0.ffn_down.weight": (rng.standard_normal((96, 64)), "Q4_0"),
    })
    fields, tensors = read_gguf_index(str(path))
    assert fields["general.architecture"] == "llama" and fields["general.name"] == "tiny"
    assert fields["llama.attention.head_count"] == 4 and "tokenizer.ggml.tokens" not in fields  # arrays skipped
    reference = GGUFReader(str(path)).tensors
    assert [(t.name, t.dims, t.type_name, t.offset) for t in tensors] == [
        (r.name, tuple(int(d) for d in r.shape), r.tensor_type.name, int(r.data_offset)) for r in reference]


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 32)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(str(bad))
