"""`LLM(disable_log_stats=False)` logs the server's periodic stats line while generating (it logged
nothing before); the default (`disable_log_stats=True`, as vLLM's LLM) logs none."""

from __future__ import annotations

import logging
import re

import pytest

from aserve import LLM, SamplingParams
from aserve.config import ConfigError

pytestmark = pytest.mark.slow

LINE = re.compile(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                  r"Running: \d+ reqs, Waiting: \d+ reqs, Swapped: \d+ reqs, KV cache usage: [\d.]+%, "
                  r"Prefix cache hit rate: [\d.]+%")
ENGINE = dict(dtype="float32", max_model_len=128, cpu_kvcache_space=0.05, max_num_seqs=4)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aserve.engine.stats"]


@pytest.mark.parametrize("kwargs, logs", [(dict(disable_log_stats=False, stats_log_interval=0.02), True),
                                          (dict(), False)])
def test_stats_line_is_logged_every_interval_when_asked(bundled_model_path, caplog, kwargs, logs):
    llm = LLM(**ENGINE, **kwargs)
    try:
        with caplog.at_level(logging.INFO, logger="aserve.engine.stats"):
            llm.generate(["Once upon a time"] * 2, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)
    finally:
        llm.engine.shutdown()
    lines = _lines(caplog)
    if not logs:
        assert lines == []
        return
    assert lines, "no stats line"  # 24 steps take longer than 20 ms
    assert all(LINE.fullmatch(line) for line in lines), lines
    assert any(float(re.search(r"generation throughput: ([\d.]+)", line).group(1)) > 0 for line in lines)


def test_bad_interval_and_reasoning_parser_are_refused():
    with pytest.raises(ConfigError, match="stats_log_interval"):
        LLM(**ENGINE, disable_log_stats=False, stats_log_interval=0)
    with pytest.raises(ConfigError, match="reasoning_parser is a server option"):
        LLM(**ENGINE, structured_outputs_config={"reasoning_parser": "deepseek_r1"})
