"""Multi-step decode in the async engine: with --multi-step-stream-outputs (the default) each decode
step's tokens reach the request's stream while the multi-step call is still running (through the
thread executor and through the worker process's pipe); without it they arrive together when the
call ends. Either way the tokens are single-step decoding's."""

from __future__ import annotations

import anyio
import pytest

from aserve import LLM, SamplingParams
from tests.engine.test_async_engine import _collect, _engine

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 13


def _run(path: str, backend: str, stream: bool):
    """(tokens, deliveries): each delivery is (during an executor call?, tokens it carried)."""
    engine = _engine(path, distributed_executor_backend=backend, num_scheduler_steps=6,
                     multi_step_stream_outputs=stream, disable_async_output_proc=True)
    in_call = [False]
    deliveries: list[tuple[bool, int]] = []
    core = engine.engine.core
    execute, deliver = core.execute_model, engine._deliver

    def recording_execute(so, on_progress=None):
        in_call[0] = True
        try:
            return execute(so, on_progress)
        finally:
            in_call[0] = False

    def recording_deliver(outputs, step_time):
        deliveries.append((in_call[0], sum(len(o.new_token_ids) for o in outputs.outputs)))
        deliver(outputs, step_time)

    core.execute_model, engine._deliver = recording_execute, recording_deliver
    tokens: list[int] = []

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            tokens.extend(await _collect(engine, "r", PROMPT, MAX_TOKENS))
            engine.shutdown()

    anyio.run(main)
    return tokens, deliveries


@pytest.fixture(scope="module")
def single_step_tokens(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_streamed_steps_reach_the_stream_before_the_call_ends(tiny_llama, single_step_tokens, backend):
    tokens, deliveries = _run(tiny_llama, backend, stream=True)
    assert tokens == single_step_tokens
    during = [n for in_call, n in deliveries if in_call]
    # 13 tokens: the prompt step's one, then calls of 6 and 6 steps; all but each call's last step stream
    assert during == [1] * 10
    assert all(n <= 1 for _, n in deliveries)


def test_without_streaming_a_call_delivers_its_tokens_at_its_end(tiny_llama, single_step_tokens):
    tokens, deliveries = _run(tiny_llama, "uni", stream=False)
    assert tokens == single_step_tokens
    assert not any(in_call for in_call, _ in deliveries)
    assert [n for _, n in deliveries if n] == [1, 6, 6]
