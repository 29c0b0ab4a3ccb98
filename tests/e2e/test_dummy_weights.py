"""`--load-format dummy` builds every native family (random weights of the checkpoint's shapes, for
benchmarks) and generates: the configs of tests/e2e/test_model_families.py, weights never read."""

from __future__ import annotations

import pytest

from aserve import LLM, SamplingParams
from aserve.config import SUPPORTED_ARCHITECTURES
from tests.e2e.test_model_families import FAMILIES
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

ONE_PER_FAMILY = list({family: name for name, (family, _) in reversed(FAMILIES.items())}.values())  # first config per family


@pytest.mark.parametrize("family", ONE_PER_FAMILY)
def test_dummy_weights_build_and_generate(tmp_path, family):
    name, overrides = FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=1, **{**GREEDY_STABLE, **overrides})
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()  # dummy loading must not need them
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              cpu_kvcache_space=0.02)
    assert llm.engine.config.model.arch.architecture in SUPPORTED_ARCHITECTURES
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True,
                                                                          detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
