"""The scheduler's engine arguments (config/scheduler_args.py): multi-step decode's flags parse with
vLLM's spellings, resolve into SchedulerConfig, and bad values or combinations are refused by name."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.server.args import parse_args


def test_multi_step_flags_parse_and_resolve(tiny_llama):
    engine, _ = parse_args(["--num-scheduler-steps", "8", "--no-multi-step-stream-outputs"], environ={})
    assert engine.num_scheduler_steps == 8 and engine.multi_step_stream_outputs is False
    default, _ = parse_args([], environ={})
    assert default.num_scheduler_steps == 1 and default.multi_step_stream_outputs is True
    config = EngineArgs(model=tiny_llama, num_scheduler_steps=8, multi_step_stream_outputs=False).create_config(
        model_path=tiny_llama)
    assert config.scheduler.num_scheduler_steps == 8 and config.scheduler.multi_step_stream_outputs is False


@pytest.mark.parametrize("kwargs,message", [
    ({"num_scheduler_steps": 0}, "--num-scheduler-steps: must be >= 1, got 0"),
    ({"num_scheduler_steps": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "--num-scheduler-steps: 4 \\(multi-step decode\\) cannot be combined with speculative decoding"),
    ({"max_num_partial_prefills": 0}, "--max-num-partial-prefills: must be >= 1"),
    ({"scheduler_cls": "NoDots"}, "--scheduler-cls: must be a dotted path"),
])
def test_bad_scheduler_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**kwargs).validate()


@pytest.mark.parametrize("device, backend, want", [
    ("cpu", "uni", False),  # the runner thread shares the GIL with the scheduler
    ("cpu", "mp", True),
    ("cuda", "uni", False),  # measured slower on an H200 (README, async_scheduling)
    ("cuda", "mp", True),
])
def test_async_scheduling_default_by_device_and_executor(tiny_llama, device, backend, want):
    config = EngineArgs(model=tiny_llama, device=device, distributed_executor_backend=backend).create_config(
        model_path=tiny_llama, cuda_available=device == "cuda")
    assert config.scheduler.async_scheduling is want
    assert config.scheduler.max_steps_in_flight == (2 if want else 1)
    off = EngineArgs(model=tiny_llama, device=device, distributed_executor_backend=backend,
                     async_scheduling=False).create_config(model_path=tiny_llama, cuda_available=device == "cuda")
    assert off.scheduler.async_scheduling is False
