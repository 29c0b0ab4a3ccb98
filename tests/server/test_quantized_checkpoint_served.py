"""Quantized checkpoints through the OpenAI server with the `openai` SDK, once per family of formats: GPTQ
(act-order, written in-test: tests/model/quantization/_quantized_checkpoints.py), compressed-tensors FP8 /
W8A16 / W8A8 (_ct_checkpoints.py) and bitsandbytes NF4 (quantized and saved by transformers + bitsandbytes:
_bnb_checkpoints.py). Greedy completions of token-id prompts equal Hugging Face's on the checkpoint's
dequantized fp32 copy (W8A8, whose activations are quantized too: the offline engine's)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.test_hf_equivalence import PROMPTS
from tests.model.quantization._quantized_checkpoints import build
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args
from tests.support.tiny_models import hf_greedy

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 8


def _served_greedy(quant, prompts: list[list[int]]) -> list[list[int]]:
    """The server's greedy completions (token ids) of `prompts`, with the checkpoint `quant` served as is."""
    with serving(str(quant), quiet_args(), skip_tokenizer_init=True, max_model_len=128, dtype="float32") as (
            _, address):
        client = openai.OpenAI(base_url=f"{address.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=str(quant), prompt=prompts, max_tokens=MAX_NEW, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})
    choices = sorted(out.choices, key=lambda c: c.index)
    return [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in choices]


def test_gptq_checkpoint_served_greedy_matches_hf_on_its_dequantized_copy(tmp_path):
    quant, deq = build(tmp_path, "gptq", group_size=64, desc_act=True, sym=False, v1=True, intermediate_size=96)
    prompts = PROMPTS[:3]
    reference = hf_greedy(str(deq), prompts, MAX_NEW, ignore_eos=True)
    assert _served_greedy(quant, prompts) == reference


def test_bitsandbytes_checkpoint_served_greedy_matches_hf_on_its_dequantized_copy(tmp_path):
    """A transformers + bitsandbytes NF4 (double quant) checkpoint, served with no quantization flag."""
    pytest.importorskip("bitsandbytes")
    from tests.model.quantization._bnb_checkpoints import build_bnb
    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    src = tmp_path / "src"
    save_tiny_hf(src, "llama", seed=0, **{**GREEDY_STABLE, "hidden_size": 128, "tie_word_embeddings": False})
    quant, deq, _ = build_bnb(src, tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True)
    prompts = PROMPTS[:3]
    reference = hf_greedy(str(deq), prompts, MAX_NEW, ignore_eos=True)
    assert _served_greedy(quant, prompts) == reference


@pytest.mark.parametrize("scheme", ["fp8", "w8a16", "w8a8"])
def test_compressed_tensors_checkpoints_served(tmp_path, scheme):
    """compressed-tensors FP8 and W8A16 (weight-only: HF on the dequantized copy is the reference) and W8A8
    (activations quantized per token: the offline engine on the same checkpoint is the reference)."""
    from aserve import LLM, SamplingParams
    from tests.model.quantization._ct_checkpoints import build_ct

    quant, deq = build_ct(tmp_path, scheme)
    prompts = PROMPTS[:3]
    if scheme == "w8a8":
        llm = LLM(model=str(quant), dtype="float32", max_model_len=128, skip_tokenizer_init=True)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False),
                                use_tqdm=False)
            reference = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.engine.shutdown()
    else:
        reference = hf_greedy(str(deq), prompts, MAX_NEW, ignore_eos=True)
    assert _served_greedy(quant, prompts) == reference
