"""The periodic stats line, shared by the server and the offline LLM (aserve.engine.stats)."""

from __future__ import annotations

from aserve.core.stats import SchedulerStats
from aserve.engine.stats import IntervalStatLineLogger, IterationStats


def test_interval_logger_logs_from_record_once_per_interval():
    now = [0.0]
    lines: list[str] = []
    logger = IntervalStatLineLogger(interval=5.0, clock=lambda: now[0], log=lines.append)
    busy = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5)
    for t in (1.0, 2.0, 4.9):  # within the first interval: summed, not logged
        now[0] = t
        logger.record(busy, IterationStats(num_prompt_tokens=10 if t == 1.0 else 0, num_generation_tokens=2))
    assert lines == []
    now[0] = 5.0
    logger.record(busy, IterationStats(num_generation_tokens=4))
    assert lines == [("Avg prompt throughput: 2.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 2 reqs, "
                      "Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 0.0%")]
    now[0] = 9.0
    logger.record(busy, IterationStats(num_generation_tokens=1))
    assert len(lines) == 1
    now[0] = 10.0
    logger.record(busy, IterationStats(num_generation_tokens=1))
    assert len(lines) == 2 and "generation throughput: 0.4 tokens/s" in lines[1]
