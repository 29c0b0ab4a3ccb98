"""Fixtures for server tests: a small real tokenizer, the fake engine, and a real server on 127.0.0.1."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules beside this file

from fake_engine import FakeAsyncEngine, build_tokenizer  # noqa: E402
from server_harness import quiet_args, running_server  # noqa: E402

from aserve.server.launch import BoundAddress  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> FakeAsyncEngine:
    return FakeAsyncEngine(tokenizer, max_model_len=256, served_model_names=("fake-model", "fake-alias"))


@pytest.fixture(scope="module")
def server(engine: FakeAsyncEngine) -> Iterator[BoundAddress]:
    with running_server(engine, quiet_args()) as address:
        yield address


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
