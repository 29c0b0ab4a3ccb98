"""The executors: ThreadExecutor (runner on the calling thread; here a fake runner) and ProcessExecutor
(the real ModelRunner in a spawned worker, on a tiny model): start -> RunnerInfo, a step, a runner
failure is fatal and stays fatal, shutdown joins the worker."""

from __future__ import annotations

import os

import pytest

from aserve.config import EngineArgs
from aserve.core.batch import CachedRequestData, NewRequestData, RunnerInfo, SchedulerOutput
from aserve.executor.base import ExecutorDeadError
from aserve.executor.process import ProcessExecutor
from aserve.executor.thread import ThreadExecutor
from aserve.sampling_params import SamplingParams
from tests.support.fake_model import FakeModel, FakeRunner, build_model_folder, engine_args
from tests.support.tiny_models import hf_greedy

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def first_step(req_id: str = "r") -> SchedulerOutput:
    """One new request whose whole prompt is computed this step (so it samples its first token)."""
    new = NewRequestData(req_id=req_id, prompt_token_ids=PROMPT, output_token_ids=[], sampling_params=GREEDY,
                         block_ids=[1], num_computed_tokens=0, stop_token_ids_for_min_tokens=[])
    return SchedulerOutput(new_requests=[new], cached_requests=[], scheduled_req_ids=[req_id],
                           num_scheduled_tokens=[len(PROMPT)], finished_req_ids=[])


def unknown_request_step() -> SchedulerOutput:
    """A step for a request the runner never saw: the runner raises (no single request owns that)."""
    return SchedulerOutput(new_requests=[], cached_requests=[CachedRequestData("ghost", [], 3)],
                           scheduled_req_ids=["ghost"], num_scheduled_tokens=[1], finished_req_ids=[])


# -- ThreadExecutor ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_config(tmp_path_factory):
    folder = build_model_folder(tmp_path_factory.mktemp("fake_model"))
    return folder, engine_args(folder).create_config(model_path=folder)


def test_thread_executor_starts_the_runner_and_runs_steps(fake_config):
    folder, config = fake_config
    model = FakeModel.for_folder(folder)
    runners = []

    def make_runner(c):
        runners.append(FakeRunner(c, model))
        return runners[-1]

    executor = ThreadExecutor(config, make_runner)
    info = executor.start()
    assert isinstance(info, RunnerInfo) and info.block_size == config.cache.block_size
    assert info.num_blocks == model.num_blocks and runners[0].loaded
    out = executor.execute(first_step())
    assert out.req_ids == ["r"]
    assert out.sampled_token_ids == [model.expected_token_ids(PROMPT, GREEDY, length=1)]
    executor.shutdown()
    assert executor.runner is None


def test_thread_executor_runner_exception_is_fatal_and_stays_fatal(fake_config):
    folder, config = fake_config
    model = FakeModel.for_folder(folder)
    executor = ThreadExecutor(config, lambda c: FakeRunner(c, model))
    executor.start()
    model.fatal = RuntimeError("device lost")
    with pytest.raises(ExecutorDeadError, match="device lost"):
        executor.execute(first_step())
    model.fatal = None  # the runner would work again, but its state is unknown: the executor stays dead
    with pytest.raises(ExecutorDeadError, match="failed earlier"):
        executor.execute(first_step("s"))
    assert model.num_steps == 0


def test_thread_executor_request_failure_is_not_fatal(fake_config):
    folder, config = fake_config
    model = FakeModel.for_folder(folder)
    model.fail_if = lambda req_id, prompt: "bad logits processor" if req_id == "bad" else None
    executor = ThreadExecutor(config, lambda c: FakeRunner(c, model))
    executor.start()
    out = executor.execute(first_step("bad"))
    assert out.failed_requests == {"bad": "bad logits processor"} and out.req_ids == []
    assert executor.execute(first_step("good")).req_ids == ["good"]


# -- ProcessExecutor --------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def tiny_config(tiny_llama):
    return EngineArgs(model=tiny_llama, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.01, enforce_eager=True).create_config(model_path=tiny_llama)


@pytest.mark.timeout(180)
def test_process_executor_step_matches_hf_then_a_runner_error_is_fatal(tiny_config, tiny_llama):
    executor = ProcessExecutor(tiny_config)
    try:
        info = executor.start()
        assert info.num_blocks > 1 and info.block_size == tiny_config.cache.block_size and info.device == "cpu"
        out = executor.execute(first_step())
        assert out.req_ids == ["r"]
        assert out.sampled_token_ids == [hf_greedy(tiny_llama, [PROMPT], 1, ignore_eos=True)[0]]
        with pytest.raises(ExecutorDeadError, match="model worker failed"):
            executor.execute(unknown_request_step())
        with pytest.raises(ExecutorDeadError, match="model worker failed"):  # and it stays dead
            executor.execute(first_step("s"))
    finally:
        pid = executor.pid
        executor.shutdown()
    assert not _alive(pid)


@pytest.mark.timeout(180)
def test_process_executor_shutdown_joins_the_worker(tiny_config):
    executor = ProcessExecutor(tiny_config)
    executor.start()
    pid = executor.pid
    assert _alive(pid)
    executor.shutdown()
    assert not _alive(pid)  # joined (reaped), not left running or as a zombie
    assert executor.pid is None


@pytest.mark.timeout(180)
def test_process_executor_submits_in_order_and_its_pipe_says_when_a_reply_is_there(tiny_config, monkeypatch):
    """A small step is written by `submit` itself, a large one by the sender thread; a small one after a
    large one still waits its turn. `reply_fileno` turns readable once the oldest reply is there."""
    import select

    from aserve.executor import process

    executor = ProcessExecutor(tiny_config)
    try:
        executor.start()
        fd = executor.reply_fileno()
        assert fd is not None
        monkeypatch.setattr(process, "_DIRECT_SEND_BYTES", 0)  # "a" counts as large: the sender writes it
        executor.submit(first_step("a"))
        monkeypatch.undo()
        executor.submit(first_step("b"))
        for want in ("a", "b"):
            assert select.select([fd], [], [], 60)[0] == [fd]
            assert executor.collect().req_ids == [want]
        assert executor._queued_sends == 0
    finally:
        executor.shutdown()
