"""Multi-step decode in the runner: the decode steps of a call after its first (`core/multi_step.py`
is the scheduler's side).

The call's first step runs as any step. Each later step k feeds every request that still has steps
(`decode_steps[req_id] > k`) its token sampled at step k - 1: one decode row per request, at the next
position, in KV slots the scheduler reserved, through the same forward paths (CUDA graphs, the CPU
compiled decode, LoRA), grammars and sampling state (penalties and seeds see every token, as in
single steps). While the step's requests are the previous step's, its inputs are the previous
step's advanced in place on the device (`advance_decode_inputs`: tokens, positions, context
lengths, slots); when some request has run its count, the smaller batch is packed anew. The runner
does not apply stop rules; the scheduler drops what follows a stop.

Outputs: without `on_progress` one `RunnerOutput` holds each request's tokens of every step in
order (`decode_step` 0). With it, each step's output but the last goes to `on_progress` as soon as
it is sampled, and the last is returned; each carries its own step's `failed_requests` and
`decode_step`. A request that fails at some step is reported failed then and is left out of every
later step (and, without `on_progress`, its earlier tokens are dropped: it fails as a whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aserve.core.batch import RunnerOutput, TokenLogprobs
from aserve.runner.input_batch import ModelInputs, advance_decode_inputs
from aserve.runner.step_sampling import StepSamples

if TYPE_CHECKING:
    from aserve.runner.model_runner import ModelRunner


def run_later_decode_steps(runner: ModelRunner, decode_steps: dict[str, int], inputs: ModelInputs,
                           first: StepSamples, failed: dict[str, str], forward_time: float,
                           on_progress: Callable[[RunnerOutput], None] | None) -> RunnerOutput:
    """Runs steps 1.. of a multi-step call after its first step (`inputs`, sampled into `first` and
    counted as computed; `failed`: that step's failures). Returns the call's output as the module
    docstring says."""
    order = list(first.req_ids)
    tokens: dict[str, list[int]] = dict(zip(first.req_ids, first.token_ids))
    logprobs: dict[str, list[TokenLogprobs]] = dict(zip(first.req_ids, first.logprobs))
    step_output = _output(first, failed, forward_time, 0)
    num_steps = max(decode_steps.values())
    for k in range(1, num_steps):
        active = [r for r in step_output.req_ids if decode_steps.get(r, 1) > k and r in runner.states]
        if not active:
            break
        if on_progress is not None:
            on_progress(step_output)
        step_failed: dict[str, str] = {}
        if active == inputs.req_ids and active == step_output.req_ids:  # the same batch: advance in place
            inputs = advance_decode_inputs(inputs, [t[-1] for t in step_output.sampled_token_ids], runner.block_size)
        else:
            inputs = runner.prepare(active, [1] * len(active), {})
        samples, seconds = _decode_step(runner, inputs, step_failed)
        step_output = _output(samples, step_failed, seconds, k)
        forward_time += seconds
        for req_id in step_failed:
            tokens.pop(req_id, None)
        failed.update(step_failed)
        for req_id, new, lps in zip(samples.req_ids, samples.token_ids, samples.logprobs):
            tokens[req_id] = tokens[req_id] + new
            logprobs[req_id] = logprobs[req_id] + lps
    if on_progress is not None:
        return step_output
    kept = [r for r in order if r in tokens and r not in failed]
    return RunnerOutput(req_ids=kept, sampled_token_ids=[tokens[r] for r in kept],
                        logprobs=[logprobs[r] for r in kept], failed_requests=failed, forward_time=forward_time)


def _decode_step(runner: ModelRunner, inputs: ModelInputs, failed: dict[str, str]) -> tuple[StepSamples, float]:
    """One decode row per request of `inputs` (each has every token but its last computed): forward,
    sample, count the row computed. Failures go to `failed` (their state is dropped)."""
    fill = runner.structured.start_fill(inputs.sample_req_ids)
    hidden, seconds = runner.timed_forward(inputs)
    samples = runner.sample(hidden, inputs, {}, fill)
    runner.fail(samples.failed, failed, {})
    for req_id in inputs.req_ids:
        state = runner.states.get(req_id)
        if state is not None:
            state.num_computed_tokens += 1
    return samples, seconds


def _output(samples: StepSamples, failed: dict[str, str], forward_time: float, step: int) -> RunnerOutput:
    return RunnerOutput(req_ids=samples.req_ids, sampled_token_ids=samples.token_ids, logprobs=samples.logprobs,
                        failed_requests=dict(failed), forward_time=forward_time, decode_step=step)
