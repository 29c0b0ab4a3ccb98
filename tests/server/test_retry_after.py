"""`DrainRate`: Retry-After from the recent drain rate, growing with the queue, clamped to [1, 60] s."""

from __future__ import annotations

from aserve.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from aserve.server.retry_after import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, DrainRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished(num: int, prompt_tokens: int = 0) -> IterationStats:
    req = FinishedRequestStats("stop", 1.0, 4, 4, 4, 1, 0.0, 0.1, 0.9, 1.0, 0.2)
    return IterationStats(num_prompt_tokens=prompt_tokens, finished_requests=[req] * num)


def test_wait_is_the_queue_over_the_recent_rate():
    clock = Clock()
    rate = DrainRate(window_s=30.0, clock=clock)
    for _ in range(20):  # 2 requests and 100 prompt tokens a second for 10 s
        clock.now += 0.5
        rate.record(SchedulerStats(), finished(1, prompt_tokens=50))
    assert rate.rates() == (2.0, 100.0)
    assert rate.retry_after_s(4) == 2
    assert rate.retry_after_s(10) == 5
    assert rate.retry_after_s(3) == 2  # rounded up
    assert rate.retry_after_s(1, num_tokens=1000) == 10  # the slower of the two drains decides


def test_wait_grows_with_the_queue_and_is_clamped():
    clock = Clock()
    rate = DrainRate(clock=clock)
    clock.now += 10
    rate.record(SchedulerStats(), finished(10))
    waits = [rate.retry_after_s(n) for n in (0, 1, 5, 20, 100, 10_000)]
    assert waits == sorted(waits)
    assert waits[0] == MIN_RETRY_AFTER_S and waits[-1] == MAX_RETRY_AFTER_S
    assert waits[2] < waits[3] < waits[4]


def test_old_steps_leave_the_window_and_an_idle_engine_asks_for_longer():
    clock = Clock()
    rate = DrainRate(window_s=30.0, clock=clock)
    clock.now += 30
    rate.record(SchedulerStats(), finished(30))  # 1 request a second
    assert rate.retry_after_s(10) == 10
    clock.now += 31  # the burst is out of the window; nothing finished since
    assert rate.retry_after_s(10) == MAX_RETRY_AFTER_S  # at most 1 request per 30 s now
    assert rate.retry_after_s(1) == 30


def test_nothing_finished_yet_means_at_most_one_request_over_the_uptime():
    clock = Clock()
    rate = DrainRate(clock=clock)
    clock.now += 0.2
    assert rate.retry_after_s(3) == 3  # spans shorter than 1 s count as 1 s
    clock.now += 3.8
    assert rate.retry_after_s(3) == 12
