"""ModelRunner.execute: a failure that belongs to one request fails that request alone.

The runner is driven directly with hand-built SchedulerOutputs (prefill, then one decode token per
step), so what is checked is the runner's contract in `core/batch.py`: the failed request is in
`failed_requests`, its state is gone, and every other request gets exactly the tokens it gets alone.
"""

from __future__ import annotations

import pytest

from aserve import SamplingParams
from aserve.config import EngineArgs
from aserve.core.batch import CachedRequestData, NewRequestData, SchedulerOutput
from aserve.runner.model_runner import ModelRunner

PROMPTS = {"greedy": [5, 17, 99, 3, 42, 8], "seeded": [300, 11, 7, 250], "other": [9, 9, 100, 23, 61, 7, 2]}
HEALTHY = {"greedy": SamplingParams(temperature=0), "seeded": SamplingParams(temperature=1.0, seed=7)}
BLOCKS_PER_REQUEST = 4
NUM_STEPS = 5


@pytest.fixture(scope="module")
def runner(tiny_llama):
    args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
                      cpu_kvcache_space=0.02, max_num_seqs=8)
    runner = ModelRunner(args.create_config(model_path=tiny_llama))
    runner.load_model()
    runner.initialize_kv_cache()
    return runner


class Driver:
    """Plays the scheduler for a few requests: a full prefill, then one token per step; requests the
    runner failed are finished (dropped) at the next step, as the scheduler does."""

    def __init__(self, runner, block_size: int):
        self.runner = runner
        self.block_size = block_size
        self.next_block = 1
        self.pending: list[NewRequestData] = []
        self.tokens: dict[str, list[int]] = {}  # req_id -> prompt + sampled
        self.computed: dict[str, int] = {}
        self.finished: list[str] = []
        self.failed: dict[str, str] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        blocks = list(range(self.next_block, self.next_block + BLOCKS_PER_REQUEST))
        self.next_block += BLOCKS_PER_REQUEST
        self.pending.append(NewRequestData(req_id, list(prompt), [], params, blocks, 0, [2]))
        self.tokens[req_id] = list(prompt)
        self.computed[req_id] = 0

    def step(self) -> None:
        live = list(self.tokens)
        counts = [len(self.tokens[r]) - self.computed[r] for r in live]
        new_ids = {n.req_id for n in self.pending}
        cached = [CachedRequestData(r, [], self.computed[r]) for r in live if r not in new_ids]
        out = self.runner.execute(SchedulerOutput(self.pending, cached, live, counts, self.finished))
        self.pending, self.finished = [], []
        for r, n in zip(live, counts):
            self.computed[r] += n
        for r, tokens in zip(out.req_ids, out.sampled_token_ids):
            self.tokens[r].extend(tokens)
        for r, message in out.failed_requests.items():
            assert r not in out.req_ids and r not in out.prompt_logprobs
            assert r not in self.runner.states  # dropped at once
            self.failed[r] = message
            del self.tokens[r], self.computed[r]
            self.finished.append(r)

    def outputs(self, req_id: str) -> list[int]:
        return self.tokens[req_id][len(PROMPTS[req_id]):]


def run(runner, requests: dict[str, SamplingParams], num_steps: int = NUM_STEPS) -> Driver:
    driver = Driver(runner, runner.block_size)
    for req_id, params in requests.items():
        driver.add(req_id, PROMPTS[req_id], params)
    for _ in range(num_steps):
        driver.step()
    driver.step()  # delivers the last failures' finish, as the scheduler would
    for req_id in list(driver.tokens):  # clean up for the next run on the same runner
        driver.finished.append(req_id)
    runner.execute(SchedulerOutput([], [], [], [], driver.finished))
    return driver


def test_a_raising_logits_processor_fails_only_its_request(runner):
    alone = run(runner, HEALTHY)
    calls = []

    def fails_on_second_call(output_ids, logits):
        calls.append(list(output_ids))
        if len(calls) == 2:
            raise RuntimeError("processor exploded")
        logits[0] += 1.0
        return logits

    together = run(runner, {"greedy": HEALTHY["greedy"],
                            "other": SamplingParams(temperature=0, logits_processors=[fails_on_second_call]),
                            "seeded": HEALTHY["seeded"]})
    assert len(calls) == 2  # it ran at the prefill step and at the first decode step, then never again
    assert list(together.failed) == ["other"]
    assert "processor exploded" in together.failed["other"] and "RuntimeError" in together.failed["other"]
    for req_id in HEALTHY:
        assert len(alone.outputs(req_id)) == NUM_STEPS + 1
        assert together.outputs(req_id) == alone.outputs(req_id)
    assert not runner.states and runner.sampler.states.num_live == 0


@pytest.mark.parametrize("breakage", ["seed beyond 64 bits", "processor signature",
                                      "bias token id beyond 64 bits"])
def test_a_request_whose_sampling_state_cannot_be_built_fails_alone(runner, breakage):
    """Intake rejects these; if one slips through, it fails its request at arrival and is never run."""
    alone = run(runner, HEALTHY)
    bad = SamplingParams(temperature=0.8)
    if breakage == "seed beyond 64 bits":
        bad.seed = 2**64
    elif breakage == "processor signature":
        bad.logits_processors = [lambda only_one: only_one]
    else:
        bad.logit_bias = {2**70: 1.0}
    together = run(runner, {"seeded": HEALTHY["seeded"], "other": bad, "greedy": HEALTHY["greedy"]})
    assert list(together.failed) == ["other"]
    assert together.failed["other"].startswith("could not set up sampling for this request: ")
    for req_id in HEALTHY:
        assert together.outputs(req_id) == alone.outputs(req_id)
    assert not runner.states and runner.sampler.states.num_live == 0


def test_a_step_whose_every_request_fails_returns_only_failures(runner):
    bad = SamplingParams(temperature=0, logits_processors=[lambda out, logits: 1 / 0])
    driver = Driver(runner, runner.block_size)
    driver.add("other", PROMPTS["other"], bad)
    driver.step()
    assert list(driver.failed) == ["other"] and "ZeroDivisionError" in driver.failed["other"]
    assert driver.tokens == {} and not runner.states and runner.sampler.states.num_live == 0
