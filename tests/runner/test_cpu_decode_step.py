"""The decode layers in one native call (runner/cpu_decode_step.py, kernels/cpu_decode_step.c): for every
RMSNorm family it serves, greedy tokens and their logprobs are bitwise those of the layer-by-layer
forward (the reference, `ASERVE_CPU_DECODE_STEP=0`) in a bf16 model, with bf16 and 4-bit projections,
biases, sliding windows, a partial rotary, per-head q/k norms and Gemma's layer form, over batches that
grow and shrink; for GPT-2, OPT (pre- and post-LN) and the MoE families, whose layers norm or route in
torch, the same greedy tokens with logprobs within bf16 rounding; models it does not serve keep the layers."""

from __future__ import annotations

import pytest

from aserve import LLM, SamplingParams
from aserve.kernels import cpu_ops
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

kernels = cpu_ops.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.packed_matmuls,
                                reason="needs the C kernels with packed products (AVX512-BF16 or AVX2)")

PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in (5, 19, 33, 2, 41)]
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "mistral": ("mistral", {"sliding_window": 8}),  # prompts longer than the window
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),  # rotates half of each head
    "qwen3": ("qwen3", {"head_dim": 16}),  # q/k normalized per head
    # normalized attention and MLP outputs, 1 + w norms, GELU-tanh, soft-capped scores, a window
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}),
    # per-head q/k norms and a local rotary table for the sliding layers
    "gemma3": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"]}),
}


def _outputs(path: str, monkeypatch, native: bool, max_tokens: list[int], team_threads: int | None = None,
             prompts: list[list[int]] = PROMPTS, max_model_len: int = 128, **kwargs) -> tuple[list, int]:
    """(each request's (tokens, logprobs), native step calls): greedy, 3 logprobs per token; requests
    end at different lengths, so the batch shrinks. `team_threads`: the native step's team (None: as built)."""
    monkeypatch.setenv("ASERVE_CPU_DECODE_STEP", "1" if native else "0")
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_model_len, cpu_kvcache_space=0.02,
              block_size=8, **kwargs)
    runner = llm.engine.core._executor.runner
    calls = [0]
    if native:
        assert runner.cpu_step is not None
        if team_threads is not None:
            runner.cpu_step.team_threads = team_threads
        run = runner.cpu_step.run

        def counted(*args):
            calls[0] += 1
            return run(*args)

        runner.cpu_step.run = counted
    else:
        assert runner.cpu_step is None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3, detokenize=False)
              for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls[0]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_one_call_equals_the_layers_bitwise(tmp_path, monkeypatch, family, quantization):
    name, overrides = FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=5, perturb=True, **{**GREEDY_STABLE, **overrides})
    lengths = [12, 5, 9, 16, 3]
    layers, _ = _outputs(str(tmp_path), monkeypatch, False, lengths, quantization=quantization)
    native, calls = _outputs(str(tmp_path), monkeypatch, True, lengths, quantization=quantization)
    assert native == layers
    assert calls >= max(lengths) - 1  # every decode step went through the native call


@pytest.mark.parametrize("family, quantization", [("llama", None), ("llama", "int4"), ("gemma3", None),
                                                  ("qwen2", "int4")])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_team_of_threads_equals_the_layers_bitwise(tmp_path, monkeypatch, family, quantization, threads):
    """The step on one team (kernels/cpu_team.h), here with more threads than this machine has cores, so
    the OS pauses some in the middle of chunks the others then take over: the same bits; 1 = a region per
    kernel."""
    name, overrides = FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=5, perturb=True, **{**GREEDY_STABLE, **overrides})
    lengths = [12, 5, 9, 16, 3]
    layers, _ = _outputs(str(tmp_path), monkeypatch, False, lengths, quantization=quantization)
    native, calls = _outputs(str(tmp_path), monkeypatch, True, lengths, team_threads=threads,
                             quantization=quantization)
    assert native == layers
    assert calls >= max(lengths) - 1


@pytest.mark.skipif(kernels is None or kernels.attention_isa != "avx2", reason="the AVX2 decode attention splits")
def test_a_team_splits_long_sequences_keys_as_the_kernel_does(tmp_path, monkeypatch):
    """A small batch with 256+ keys a sequence: decode attention splits each sequence's keys into runs merged
    after (kernels/cpu_attention_avx2.c); the team's step (3 threads) splits them as the kernel called alone
    (a region per kernel) does: the same bits."""
    save_tiny_hf(tmp_path, "llama", seed=5, perturb=True, **GREEDY_STABLE)
    monkeypatch.setenv("ASERVE_CPU_DECODE_STEP", "1")
    llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512, cpu_kvcache_space=0.02,
              block_size=8)
    step = llm.engine.core._executor.runner.cpu_step
    prompts = [{"prompt_token_ids": [(11 * i + 5) % 500 + 3 for i in range(n)]} for n in (300, 270)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3, detokenize=False)
              for n in (8, 5)]
    outputs = {}
    for threads in (1, 3):
        step.team_threads = threads
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[threads] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert outputs[3] == outputs[1]


@pytest.mark.parametrize("family", ["gpt2", "opt", "opt_post_ln"])
def test_a_team_of_threads_equals_one_region_per_kernel_for_the_layernorm_forms(tmp_path, monkeypatch, family):
    """GPT-2 and OPT (pre- and post-LN) on a team of 3 threads: bitwise the step with a region per kernel."""
    name, overrides, quantization = CLOSE_FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=5, perturb=True, **{**GREEDY_STABLE, **overrides})
    lengths = [12, 5, 9, 16, 3]
    one, _ = _outputs(str(tmp_path), monkeypatch, True, lengths, team_threads=1, quantization=quantization)
    team, _ = _outputs(str(tmp_path), monkeypatch, True, lengths, team_threads=3, quantization=quantization)
    assert team == one


@pytest.mark.timeout(300)
def test_a_worker_process_with_a_team_of_threads_equals_the_layers(tmp_path, monkeypatch):
    """The `mp` worker (as the server runs it: async scheduling) with 3 threads on the team: bitwise the layers."""
    name, overrides = FAMILIES["llama"]
    save_tiny_hf(tmp_path, name, seed=5, perturb=True, **{**GREEDY_STABLE, **overrides})
    lengths = [12, 5, 9, 16, 3]
    layers, _ = _outputs(str(tmp_path), monkeypatch, False, lengths)
    monkeypatch.setenv("ASERVE_CPU_DECODE_STEP", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the spawned worker's torch threads, so its team
    llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.02,
              block_size=8, distributed_executor_backend="mp", async_scheduling=True)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3, detokenize=False)
                  for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == layers


# Families whose layers compute the norm (LayerNorm), the plain activation or the routing in torch ops.
CLOSE_FAMILIES = {
    "gpt2": ("gpt2", {}, None),  # learned positions, LayerNorms with biases, GELU-tanh (gelu_new)
    "gpt2_exact_gelu": ("gpt2", {"activation_function": "gelu"}, None),
    "opt": ("opt", {}, "int4"),  # ReLU
    "opt_post_ln": ("opt", {"do_layer_norm_before": False}, None),
    "mixtral": ("mixtral", {}, "int4"),  # 4 experts, top 2, renormalized
    # 8 experts, top 2 unnormalized, a sigmoid-gated shared expert, and a dense layer
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": [1]}, None),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16}, None),  # q/k norms
}


@pytest.mark.parametrize("family", list(CLOSE_FAMILIES))
def test_one_call_agrees_with_the_layers_within_rounding(tmp_path, monkeypatch, family):
    name, overrides, quantization = CLOSE_FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=5, perturb=True, **{**GREEDY_STABLE, **overrides})
    lengths = [12, 5, 9, 16, 3]
    layers, _ = _outputs(str(tmp_path), monkeypatch, False, lengths, quantization=quantization)
    native, calls = _outputs(str(tmp_path), monkeypatch, True, lengths, quantization=quantization)
    assert [tokens for tokens, _ in native] == [tokens for tokens, _ in layers]
    for (tokens, got), (_, want) in zip(native, layers):
        for token, step_got, step_want in zip(tokens, got, want):
            assert step_got[token].logprob == pytest.approx(step_want[token].logprob, abs=0.01)
    assert calls >= max(lengths) - 1


@pytest.mark.parametrize("family, dtype", [("llama", "float32")])
def test_models_it_does_not_serve_keep_the_layers(tmp_path, monkeypatch, family, dtype):
    save_tiny_hf(tmp_path, family, seed=5, **GREEDY_STABLE)
    monkeypatch.setenv("ASERVE_CPU_DECODE_STEP", "1")
    llm = LLM(str(tmp_path), dtype=dtype, skip_tokenizer_init=True, max_model_len=64, cpu_kvcache_space=0.01)
    assert llm.engine.core._executor.runner.cpu_step is None


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoints_use_it_unless_act_order_permutes_the_input(tmp_path, monkeypatch, desc_act):
    """A GPTQ act-order layer permutes x before its 4-bit matmul (`input_perm`): the C step, which
    multiplies x as it is, must leave such a model to the layers."""
    from tests.model.quantization._quantized_checkpoints import build

    quant, _ = build(tmp_path, "gptq", group_size=32, desc_act=desc_act, sym=True, v1=True)
    monkeypatch.setenv("ASERVE_CPU_DECODE_STEP", "1")
    llm = LLM(str(quant), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64, cpu_kvcache_space=0.01)
    assert (llm.engine.core._executor.runner.cpu_step is None) == desc_act
    if not desc_act:
        lengths = [6] * len(PROMPTS)
        layers, _ = _outputs(str(quant), monkeypatch, False, lengths)
        native, calls = _outputs(str(quant), monkeypatch, True, lengths)
        assert native == layers and calls > 0
