"""Every native family through the OpenAI server: a batched /v1/completions request of token-id
prompts (greedy, --skip-tokenizer-init) returns Hugging Face transformers' greedy tokens, one
server per family (tiny fp32 models built here; the same configs as tests/e2e/test_model_families.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_hf_equivalence import PROMPTS
from tests.e2e.test_model_families import FAMILIES
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args
from tests.support.tiny_models import GREEDY_STABLE, hf_greedy, save_tiny_hf

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 8
SERVED = list({family: name for name, (family, _) in reversed(FAMILIES.items())}.values())  # first config per family


@pytest.mark.parametrize("family", SERVED)
def test_family_served_greedy_matches_hf(tmp_path, family):
    name, overrides = FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=1234, perturb=True, **{**GREEDY_STABLE, **overrides})
    prompts = PROMPTS[:4]
    reference = hf_greedy(str(tmp_path), prompts, MAX_NEW, ignore_eos=True)
    with serving(str(tmp_path), quiet_args(), skip_tokenizer_init=True, max_model_len=128) as (_, address):
        body = {"prompt": prompts, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        r = httpx.post(f"{address.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    got = [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]
    assert got == reference
