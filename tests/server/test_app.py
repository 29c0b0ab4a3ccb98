"""create_app wiring and per-request logging, without a network server."""

from __future__ import annotations

import logging

import pytest

from aserve.sampling_params import SamplingParams
from aserve.server.app import create_app
from aserve.server.metrics import PrometheusStatLogger
from tests.server.server_harness import quiet_args, recording_engine


@pytest.fixture
def engine(model_folder, fake_model):
    return recording_engine(model_folder, fake_model)


def test_create_app_registers_its_metrics_with_the_engine(engine):
    app_a, app_b = create_app(engine, quiet_args()), create_app(engine, quiet_args())
    loggers = [x for x in engine.engine.stat_loggers if isinstance(x, PrometheusStatLogger)]
    assert loggers == [app_a.state.aserve.metrics, app_b.state.aserve.metrics]
    assert loggers[0].registry is not loggers[1].registry


def test_request_log_line_is_cut_at_max_log_len(engine, caplog):
    state = create_app(engine, quiet_args(disable_log_requests=False, max_log_len=5)).state.aserve
    with caplog.at_level(logging.INFO, logger="aserve.server"):
        state.log_request("req-1", "abcdefghij", list(range(100)), SamplingParams(max_tokens=3))
    (record,) = [r for r in caplog.records if "req-1" in r.getMessage()]
    message = record.getMessage()
    assert "'abcde'" in message and "abcdef" not in message
    assert "[0, 1, 2, 3, 4]" in message and "max_tokens=3" in message


def test_disable_log_requests(engine, caplog):
    state = create_app(engine, quiet_args(disable_log_requests=True)).state.aserve
    with caplog.at_level(logging.INFO, logger="aserve.server"):
        state.log_request("req-2", "hello", [1, 2], SamplingParams())
    assert not [r for r in caplog.records if "req-2" in r.getMessage()]
