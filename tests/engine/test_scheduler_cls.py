"""--scheduler-cls: a Scheduler subclass named by dotted path runs the engine's steps; a path that does
not import or names something else fails at start-up naming the flag; vLLM's default names mean
aserve's own scheduler."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError
from aserve.core.scheduler import Scheduler
from aserve.engine.llm_engine import LLMEngine
from aserve.sampling_params import SamplingParams
from tests.support.fake_model import FakeModel, build_model_folder, engine_args, fake_executor_factory


class CountingScheduler(Scheduler):
    """Counts its schedule() calls (one per engine step)."""

    num_schedules = 0

    def schedule(self):
        type(self).num_schedules += 1
        return super().schedule()


NOT_A_SCHEDULER = object()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_model_folder(tmp_path_factory.mktemp("fake_model"))


def _engine(folder: str, scheduler_cls: str | None) -> LLMEngine:
    return LLMEngine.from_engine_args(engine_args(folder, max_model_len=64, scheduler_cls=scheduler_cls),
                                      executor_factory=fake_executor_factory(FakeModel.for_folder(folder)))


def test_custom_scheduler_class_runs_the_steps(folder):
    engine = _engine(folder, f"{__name__}.CountingScheduler")
    try:
        assert type(engine.core.scheduler) is CountingScheduler
        engine.add_request("r", None, SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=[1, 2, 3])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        assert CountingScheduler.num_schedules >= 3
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler", None])
def test_vllm_default_names_mean_the_own_scheduler(folder, path):
    engine = _engine(folder, path)
    assert type(engine.core.scheduler) is Scheduler
    engine.shutdown()


@pytest.mark.parametrize(("path", "message"), [
    ("no_such_module.Scheduler", "cannot import"), (f"{__name__}.Missing", "cannot import"),
    (f"{__name__}.NOT_A_SCHEDULER", "not a subclass"), ("not a path", "dotted path")])
def test_bad_scheduler_class_fails_at_start_up_naming_the_flag(folder, path, message):
    with pytest.raises(ConfigError, match=f"--scheduler-cls.*{message}"):
        _engine(folder, path)
