"""`--tokenizer-mode slow`: the tokenizer transformers gives for `use_fast=False` (as vLLM asks) serves the
same tokens and text as the default one; where transformers has no Python class for the model (most, in
transformers 5) that is logged; a tokenizer that cannot load is refused naming the flag."""

from __future__ import annotations

import json
import logging

import pytest

from aserve import LLM, SamplingParams
from aserve.config import ConfigError
from tests.server.real_tiny_server import build_tiny_chat_model

PROMPTS = ["the quick brown fox", "hello world, how are you"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _with_slow_files(folder) -> str:
    """The tiny chat model plus GPT-2-style vocab.json / merges.txt and a tokenizer class that has a
    slow form, written from its tokenizer.json (a byte-level BPE)."""
    path = build_tiny_chat_model(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_slow_tokenizer_gives_the_fast_ones_outputs(tmp_path, caplog):
    path = _with_slow_files(tmp_path / "tiny")
    runs = {}
    for mode in ("auto", "slow"):
        with caplog.at_level(logging.WARNING, logger="aserve.engine.builder"):
            llm = LLM(path, dtype="float32", max_model_len=128, cpu_kvcache_space=0.02, tokenizer_mode=mode)
        slow_warned = any("--tokenizer-mode slow" in r.getMessage() for r in caplog.records)
        assert slow_warned == (mode == "slow" and llm.get_tokenizer().is_fast)
        if mode == "auto":
            assert llm.get_tokenizer().is_fast
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runs[mode] = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
    assert runs["auto"] == runs["slow"]


def test_a_tokenizer_that_cannot_load_slow_is_refused(tmp_path):
    path = _with_slow_files(tmp_path / "tiny")
    (tmp_path / "tiny" / "vocab.json").write_text("not json")
    (tmp_path / "tiny" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="--tokenizer-mode slow"):
        LLM(path, dtype="float32", max_model_len=128, cpu_kvcache_space=0.02, tokenizer_mode="slow")
