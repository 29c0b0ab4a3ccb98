"""The runner's CUDA-only paths: decode CUDA graphs, GPU memory profiling, swap preemption.

The `gpu`-marked tests need a CUDA device (tests/conftest.py skips them without one). The CPU tests
check the parts of those paths that do not need one: the profiling step's inputs, and CUDA graph
replay emulated by re-running the captured call with the capture-time metadata (what a graph
freezes: host-side shapes from the capture; what it reads anew: the static device buffers).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import EngineArgs
from aserve.engine.llm_engine import LLMEngine
from aserve.executor.thread import ThreadExecutor
from aserve.runner.cuda_graphs import CudaGraphRunner, _Graph
from aserve.runner.kv_memory import ModelInputsForProfile, run_profile_step
from tests.support.tiny_models import hf_greedy

_rng = random.Random(5)
# Lengths from 3 to 45: most contexts span several blocks of 8 or 16 tokens.
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (3, 45, 17, 30, 9, 40, 24, 12)]
MAX_NEW = 8


def _generate(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(model: str, **engine_args) -> LLM:
    """An LLM whose runner the test can see: built through the public executor factory."""
    executors = []

    def factory(config):
        executors.append(ThreadExecutor(config))
        return executors[-1]

    llm = LLM.from_engine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args),
                                                     executor_factory=factory))
    llm.test_runner = executors[0].runner
    return llm


def _runner(llm: LLM):
    return llm.test_runner


def _release(*llms: LLM) -> None:
    """Drop engines and give their CUDA memory back before the next test sizes its KV cache."""
    for llm in llms:
        llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _count_calls(obj, name: str) -> list:
    """Wrap `obj.name` so each call records its first argument; returns the record."""
    calls = []
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


# -- CPU: the profiling step ---------------------------------------------------------------------
def test_profile_inputs_cover_the_largest_step():
    """80 tokens with max_model_len 32: prompts of 32, 32 and 16 tokens in disjoint scratch blocks."""
    inputs, num_blocks = ModelInputsForProfile.make(80, 32, 8, torch.device("cpu"))
    meta = inputs.meta
    assert meta.seq_lens_cpu == [32, 32, 16] and meta.seq_lens.tolist() == [32, 32, 16]
    assert meta.query_start_loc_cpu == [0, 32, 64, 80] and meta.query_start_loc.tolist() == [0, 32, 64, 80]
    assert (meta.num_tokens, meta.num_seqs, meta.num_decodes, meta.max_seq_len) == (80, 3, 0, 32)
    assert num_blocks == 1 + 4 + 4 + 2  # block 0 stays the null block
    assert inputs.input_ids.shape == (80,)
    slots = meta.slot_mapping.tolist()
    assert len(set(slots)) == 80 and min(slots) >= 8 and max(slots) < num_blocks * 8
    for i, (start, end) in enumerate(zip(meta.query_start_loc_cpu, meta.query_start_loc_cpu[1:])):
        positions = inputs.positions[start:end].tolist()
        assert positions == list(range(end - start))
        for pos, slot in zip(positions, slots[start:end]):
            assert slot == int(meta.block_tables[i, pos // 8]) * 8 + pos % 8


def test_profile_step_runs_and_keeps_the_bound_cache(tiny_llama):
    llm = _llm(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_batched_tokens=160,
              max_num_seqs=4, cpu_kvcache_space=0.01, block_size=8)
    runner = _runner(llm)
    run_profile_step(runner)  # 160 tokens as prompts of 64, 64 and 32
    assert all(layer.kv_cache is cache for layer, cache in zip(runner.model.attention_layers, runner.kv_caches))
    prompts = [PROMPTS[0], PROMPTS[2]]
    assert _generate(llm, prompts, 4) == hf_greedy(tiny_llama, prompts, 4, ignore_eos=True)


# -- CPU: CUDA graph replay, emulated -------------------------------------------------------------
class _ReplayByRerun:
    """Stands in for a captured torch.cuda.CUDAGraph: `replay()` re-runs the captured call with the
    capture-time metadata object and writes the result into the captured output tensor."""

    def __init__(self, forward, input_ids, positions, meta, output):
        self.call = lambda: forward(input_ids, positions, meta)
        self.output = output

    def replay(self) -> None:
        self.output.copy_(self.call())


def _emulate_graphs(runner) -> CudaGraphRunner:
    """What ModelRunner.capture_graphs does on CUDA, with graph capture replaced by _ReplayByRerun."""
    max_len = min(runner.config.runner.max_seq_len_to_capture, runner.config.model.max_model_len)
    g = CudaGraphRunner(runner.model, runner.static_sizes, runner.max_blocks_per_seq, max_len, runner.device)
    with torch.inference_mode():
        for size in reversed(g.sizes):
            meta = g._meta(size)
            ids, pos = g._input_ids[:size], g._positions[:size]
            out = runner.model(ids, pos, meta)
            g.graphs[size] = _Graph(_ReplayByRerun(runner.model, ids, pos, meta, out), ids, pos, meta, out)
    runner.graph_runner = g
    return g


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_emulated_graph_replay_matches_eager(tiny_llama, backend):
    """Contexts grow past several 8-token blocks while replays reuse the capture-time metadata."""
    common = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 64, "cpu_kvcache_space": 0.01,
              "block_size": 8, "max_num_seqs": 4, "attention_backend": backend}
    # The interpreter is slow: fewer, shorter runs for triton (contexts still reach 3-4 blocks).
    prompts, max_new = (PROMPTS[1:4], MAX_NEW) if backend == "torch" else ([PROMPTS[0], PROMPTS[3]], 4)
    eager = _generate(_llm(tiny_llama, **common), prompts, max_new)
    llm = _llm(tiny_llama, **common)
    g = _emulate_graphs(_runner(llm))
    replays = _count_calls(g, "run")
    assert _generate(llm, prompts, max_new) == eager
    assert len(replays) >= max_new - 1, "every decode-only step must replay"


# -- GPU ----------------------------------------------------------------------------------------
def _cuda_llm(path: str, **kwargs) -> LLM:
    base = {"dtype": "float32", "skip_tokenizer_init": True, "device": "cuda", "max_model_len": 1024,
            "block_size": 16, "num_gpu_blocks_override": 512, "max_num_seqs": 8}
    base.update(kwargs)
    return _llm(path, **base)


@pytest.mark.gpu
def test_cuda_graphs_match_eager_for_every_batch_size(tiny_llama):
    """Graph replays (padded to sizes 1, 2, 4, 8; 4 context splits captured for max_model_len 1024)
    give the eager tokens for batches of 1..8, and both give HF's."""
    reference = hf_greedy(tiny_llama, PROMPTS, MAX_NEW, ignore_eos=True)
    eager = _cuda_llm(tiny_llama, enforce_eager=True)
    graphs = _cuda_llm(tiny_llama, enforce_eager=False)
    try:
        assert _runner(eager).graph_runner is None
        g = _runner(graphs).graph_runner
        assert g is not None and sorted(g.graphs) == [1, 2, 4, 8]
        replays = _count_calls(g, "run")
        for k in range(1, 9):
            before = len(replays)
            want = _generate(eager, PROMPTS[:k])
            assert want == reference[:k], f"eager, batch of {k}"
            assert _generate(graphs, PROMPTS[:k]) == want, f"graphs, batch of {k}"
            assert len(replays) - before >= MAX_NEW - 1, f"batch of {k}: decode steps must replay graphs"
    finally:
        _release(eager, graphs)


@pytest.mark.gpu
def test_torch_backend_on_cuda_decodes_eagerly(tiny_llama):
    """The torch backend syncs with the host, so it is never captured; it still matches HF on CUDA."""
    llm = _cuda_llm(tiny_llama, attention_backend="torch", enforce_eager=False)
    try:
        assert _runner(llm).graph_runner is None
        assert _generate(llm, PROMPTS[:4]) == hf_greedy(tiny_llama, PROMPTS[:4], MAX_NEW, ignore_eos=True)
    finally:
        _release(llm)


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_gpu_memory_profiling_keeps_kv_within_budget(tiny_llama):
    """gpu_memory_utilization=0.5: weights + activations + KV stay under half the card, and the KV
    cache takes nearly all of what is left after what is in use on the card (this process's CUDA
    context included; other processes' memory counts too, so this test runs alone on the GPU)."""
    _release()
    utilization = 0.5
    free, total = torch.cuda.mem_get_info()
    budget = utilization * total
    before = total - free
    llm = _llm(tiny_llama, dtype="float32", skip_tokenizer_init=True, device="cuda", enforce_eager=True,
              gpu_memory_utilization=utilization, block_size=128, max_model_len=256, max_num_batched_tokens=512,
              max_num_seqs=8)
    try:
        info = llm.engine.core.runner_info
        runner = _runner(llm)
        kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        assert kv_bytes == info.num_blocks * info.kv_bytes_per_block > 0
        assert torch.cuda.memory_allocated() <= budget
        # The KV cache gets the budget minus weights and the profiled activations (tiny for this model).
        assert budget - before - kv_bytes < 512 * 2**20
        # The largest step (8 prompts, 512 tokens) runs inside the budget too.
        torch.cuda.reset_peak_memory_stats()
        long_prompts = [[_rng.randrange(3, 500) for _ in range(200)] for _ in range(8)]
        _generate(llm, long_prompts, 2)
        assert torch.cuda.max_memory_allocated() <= budget
    finally:
        _release(llm)


@pytest.mark.gpu
def test_swap_preemption_on_cuda_matches_hf(tiny_llama, stat_totals):
    """18 blocks of 8 tokens cannot hold 8 prompts: requests are swapped out to pinned CPU memory and
    back in (decodes replaying CUDA graphs), and the tokens still equal HF's."""
    reference = hf_greedy(tiny_llama, PROMPTS, 12, ignore_eos=True)
    llm = _cuda_llm(tiny_llama, max_model_len=128, block_size=8, num_gpu_blocks_override=18,
                    preemption_mode="swap", swap_space=0.01)
    totals = stat_totals(llm)
    try:
        runner = _runner(llm)
        assert runner.cpu_kv_caches and all(t.is_pinned() for t in runner.cpu_kv_caches)
        steps = _count_calls(runner, "_apply_block_ops")
        assert _generate(llm, PROMPTS, 12) == reference
        assert any(so.blocks_to_swap_out for so in steps) and any(so.blocks_to_swap_in for so in steps)
        assert totals.num_preemptions > 0 and totals.latest.num_used_blocks == 0
    finally:
        _release(llm)
