"""Shared fixtures: tiny random-weight HF models built on the fly, the bundled model, stat totals, and the
one GPU-skip hook (`gpu`-marked tests are skipped without CUDA)."""

from __future__ import annotations

import os

import pytest

from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

# Keep torch from oversubscribing the cores when several engines/processes run: under pytest-xdist
# every worker (and the servers it starts) gets one torch thread, otherwise two.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
else:
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


@pytest.fixture(scope="session")
def trained_tiny_llama(tmp_path_factory) -> str:
    """The tiny Llama trained on the Markov language (tests/support/trained_tiny.py), trained once per test
    run: the pytest-xdist workers share one copy (the first to take the lock trains it). Read-only: a test
    that changes a checkpoint copies the folder first."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's base folder, above every worker's own
    folder = shared / "trained_tiny_llama"
    with FileLock(str(shared / "trained_tiny_llama.lock")):
        if not (folder / "config.json").exists():
            from tests.support.trained_tiny import save_trained_tiny_llama

            staging = shared / "trained_tiny_llama.partial"
            staging.mkdir(exist_ok=True)
            save_trained_tiny_llama(staging)
            staging.rename(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf(path, "llama", seed=1234, perturb=False, tie_word_embeddings=True, **GREEDY_STABLE)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_hf(path, "qwen2", seed=1234, perturb=False, tie_word_embeddings=False, **GREEDY_STABLE)
    return str(path)


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct, converted once into the aserve cache."""
    from aserve.model_source import resolve_model

    return resolve_model("", None, None, "auto")


@pytest.fixture(scope="session")
def smol_tokenizer(bundled_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_path)


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
