"""Shared fixtures: tiny random-weight HF models built on the fly, the bundled model, HF greedy references."""

from __future__ import annotations

import os

import pytest

# Keep torch from oversubscribing the two CI cores when several engines/processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def build_tiny_model(path, arch: str = "llama", **overrides) -> str:
    """Saves a tiny random-weight HF model (fp32 safetensors) to `path`; returns the folder.

    Weights use a larger init than HF's default so logits are well separated: greedy decoding is
    then stable under float rounding differences, which keeps token-for-token comparisons meaningful.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    config = cls(**common)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct, converted once into the aserve cache."""
    from aserve.model_source import resolve_model

    return resolve_model("", None, None, "auto")


@pytest.fixture(scope="session")
def smol_tokenizer(bundled_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_path)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """Hugging Face transformers' greedy generate in fp32, one prompt at a time (no padding effects)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids))
            if ignore_eos:
                kwargs.update(eos_token_id=None, pad_token_id=0)
            out = model.generate(ids, **kwargs)
            outs.append(out[0, len(p):].tolist())
    return outs


class StatTotals:
    """A StatLogger that adds up the scheduler's per-step counter deltas and keeps the latest gauges."""

    def __init__(self) -> None:
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.latest = None

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.prefix_cache_queries += scheduler_stats.prefix_cache_queries
        self.prefix_cache_hits += scheduler_stats.prefix_cache_hits
        self.num_preemptions += scheduler_stats.num_preemptions
        self.num_steps += 1
        self.latest = scheduler_stats


@pytest.fixture
def stat_totals():
    """`stat_totals(llm)` registers a StatTotals on the LLM's engine and returns it."""

    def attach(llm) -> StatTotals:
        totals = StatTotals()
        llm.engine.stat_loggers.append(totals)
        return totals

    return attach


@pytest.fixture
def llm_with_runner():
    """`llm_with_runner(model, runner_factory=None, **engine_args)` -> (LLM, its in-process runner).

    Builds the engine through the public executor factory, so tests can see (or replace) the runner
    without reaching into the engine."""
    from aserve import LLM
    from aserve.config import EngineArgs
    from aserve.engine.llm_engine import LLMEngine
    from aserve.executor.thread import ThreadExecutor

    def build(model: str, runner_factory=None, **engine_args):
        executors = []

        def factory(config):
            executor = ThreadExecutor(config) if runner_factory is None else ThreadExecutor(config, runner_factory)
            executors.append(executor)
            return executor

        engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args),
                                            executor_factory=factory)
        return LLM.from_engine(engine), executors[0].runner

    return build
