"""--calculate-kv-scales in the runner: the first step it executes (not a start-up warm-up) computes every
layer's fp8 KV scales, which then stay fixed; decode capture waits for them (aserve/runner/model_runner.py)."""

from __future__ import annotations

from aserve import SamplingParams
from aserve.config import EngineArgs
from aserve.core.batch import CachedRequestData, NewRequestData, SchedulerOutput
from aserve.model.kv_scales import layer_scales
from aserve.runner.model_runner import ModelRunner


def test_first_executed_step_computes_the_scales_then_they_stay(tiny_llama):
    args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.01, max_num_seqs=4, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = ModelRunner(args.create_config(model_path=tiny_llama))
    runner.load_model()
    runner.initialize_kv_cache()
    runner.capture_graphs()
    assert runner.kv_scale_calc.capture_deferred  # captured once the scales exist
    assert layer_scales(runner.model) == [(1.0, 1.0)] * 2
    prompt = [5, 17, 99, 3, 42, 8, 250, 7]
    new = NewRequestData("a", prompt, [], SamplingParams(temperature=0), [1, 2], 0, [2])
    out = runner.execute(SchedulerOutput([new], [], ["a"], [len(prompt)], []))
    first = layer_scales(runner.model)
    assert all(k != 1.0 and v != 1.0 for k, v in first) and len(set(first)) == 2
    assert all(attn.kv_scales_source == "calculated" for attn in runner.model.attention_layers)
    assert not runner.kv_scale_calc.capture_deferred and not runner.kv_scale_calc.pending
    for step in range(3):  # decodes: the scales stay as the first step set them
        out = runner.execute(SchedulerOutput([], [CachedRequestData("a", [], len(prompt) + step)], ["a"], [1], []))
        assert out.req_ids == ["a"]
    assert layer_scales(runner.model) == first


def test_compiled_decode_holds_the_calculated_scales(tiny_llama, monkeypatch):
    """-O3 on CPU with --calculate-kv-scales: compiled after the first step, the decode graph uses each layer's
    computed scales (the same greedy tokens as eager with the same scales; graph captured with the `eager`
    torch.compile backend as tests/runner/test_compiled_decode.py does)."""
    from aserve.runner.compiled_decode import CompiledDecode
    from tests.runner.test_compiled_decode import _greedy

    kwargs = {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    eager = _greedy(tiny_llama, **kwargs)
    calls = []
    real_run = CompiledDecode.run
    monkeypatch.setattr(CompiledDecode, "run", lambda self, *a: calls.append(a[0].shape[0]) or real_run(self, *a))
    compiled = _greedy(tiny_llama, compilation_config={"level": 3, "compile_sizes": [1], "backend": "eager"}, **kwargs)
    assert calls and compiled == eager
    at_one = _greedy(tiny_llama, kv_cache_dtype="fp8")  # scales 1.0: a different cache, other tokens somewhere
    assert at_one != eager
