"""The team protocol of the native decode step (kernels/cpu_team.h), run by `team_selftest`: chains of
parallel ops whose every chunk depends on the previous op's output, on teams of 2-4 threads; with one
thread made to sleep 2 ms inside some of its chunks, the others take those chunks over (counted) and the
result is still exactly one thread's; the sleeper's late results are discarded, never stored."""

from __future__ import annotations

import pytest

from aserve.kernels import cpu_ops

kernels = cpu_ops.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs the C kernels")


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_ops_in_order_give_one_threads_result(threads):
    assert kernels.team_selftest(200, 37, threads, 0) >= 0  # -1: a wrong result


@pytest.mark.parametrize("threads", [2, 3])
def test_a_stalled_threads_chunks_are_taken_over(threads):
    # thread 1 sleeps 2 ms in every third chunk it computes (far past the grace period); the others,
    # 5 us a chunk, finish a few dozen ops meanwhile and take the chunk over
    assert kernels.team_selftest(300, 16, threads, 3) > 0
    assert kernels.team_selftest(300, 16, threads, 1) > 0  # ... or in every one


def test_more_chunks_than_fit_a_thread_and_single_chunk_ops():
    assert kernels.team_selftest(50, 1, 2, 2) >= 0
    assert kernels.team_selftest(5, 4096, 3, 0) >= 0
