"""Fixtures for server tests: a fake-model folder (tiny config.json + a small real tokenizer), the real
AsyncEngine over the fake model, and a real server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.server_harness import (
    RecordingAsyncEngine,
    RunningServer,
    quiet_args,
    recording_engine,
    running_server,
)
from tests.support.fake_model import FakeModel, build_model_folder

SERVED_NAMES = ["fake-model", "fake-alias"]


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory) -> str:
    return build_model_folder(tmp_path_factory.mktemp("fake_model"))


@pytest.fixture(scope="session")
def tokenizer(model_folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


@pytest.fixture(scope="module")
def fake_model(model_folder: str) -> FakeModel:
    return FakeModel.for_folder(model_folder)


@pytest.fixture(scope="module")
def running(model_folder: str, fake_model: FakeModel) -> Iterator[RunningServer]:
    """One server per module: fcfs would refuse `priority`, so the shared engine schedules by priority."""
    def make():
        return recording_engine(model_folder, fake_model, served_model_name=SERVED_NAMES,
                                scheduling_policy="priority")

    with running_server(make, quiet_args()) as server:
        yield server


@pytest.fixture(scope="module")
def server(running: RunningServer) -> RunningServer:
    return running


@pytest.fixture(scope="module")
def engine(running: RunningServer) -> RecordingAsyncEngine:
    return running.engine


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    """The official OpenAI SDK client, pointed at the module's server."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
