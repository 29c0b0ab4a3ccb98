import pytest

from aserve.core.request import Request, RequestStatus
from aserve.sampling_params import SamplingParams


def test_token_bookkeeping():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_ids=(9,))
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert r.prompt_token_ids == [1, 2, 3]
    assert (r.num_tokens, r.num_output_tokens) == (6, 3)
    assert r.status == RequestStatus.WAITING and not r.is_finished
    assert r.eos_token_ids == (9,)


def test_max_tokens_resolution():
    assert Request("a", [1] * 10, SamplingParams(max_tokens=7), max_model_len=12).max_tokens == 7
    assert Request("b", [1] * 10, SamplingParams(max_tokens=None), max_model_len=12).max_tokens == 2
    assert Request("c", [1] * 10, SamplingParams(max_tokens=None)).max_tokens > 10**9


@pytest.mark.parametrize("status,reason", [
    (RequestStatus.WAITING, None), (RequestStatus.RUNNING, None), (RequestStatus.PREEMPTED, None),
    (RequestStatus.SWAPPED, None), (RequestStatus.FINISHED_STOPPED, "stop"),
    (RequestStatus.FINISHED_LENGTH_CAPPED, "length"), (RequestStatus.FINISHED_ABORTED, "abort"),
    (RequestStatus.FINISHED_ERROR, "error"),
])
def test_status_finish_reasons(status, reason):
    assert RequestStatus.finish_reason(status) == reason
    assert RequestStatus.is_finished(status) == (reason is not None)
