"""Schemathesis fuzzing of every POST route, against a live server on the real engine.

The cases come from the server's own /openapi.json (schemathesis's Hypothesis strategies, positive
and negative, derandomized so every run sends the same inputs); they are sent 8 at a time so the
engine batches them. No answer may be a 5xx (nor a 200 stream carrying a server error), every 4xx
must be an OpenAI error body, and /health must still answer 200 afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from real_tiny_server import build_tiny_chat_model, serving
from schemathesis import GenerationMode
from server_harness import quiet_args

from aserve.server.protocol import ErrorResponse

pytestmark = pytest.mark.timeout(300)

CASES_PER_MODE = 100  # per POST operation with a body, for each of positive and negative generation
BUDGET_S = 240.0


def _collect(operation: Any, mode: GenerationMode, count: int) -> list[Any]:
    cases: list[Any] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def draw(case: Any) -> None:
        cases.append(case)

    draw()
    return cases


def _describe(case: Any) -> str:
    body = case.body if not isinstance(case.body, bytes) else case.body[:300]
    try:
        shown = json.dumps(body, ensure_ascii=True)[:600]
    except (TypeError, ValueError):
        shown = repr(body)[:600]
    return f"{case.method} {case.path} media_type={case.media_type} body={shown}"


def _problem(case: Any, response: Any) -> str | None:
    """What is wrong with this answer (None: nothing)."""
    status, content = response.status_code, response.content
    if status >= 500:
        return f"{status}: {content[:300]!r}"
    if status >= 400:
        try:
            msgspec.json.decode(content, type=ErrorResponse)
        except msgspec.MsgspecError:
            return f"{status} without an OpenAI error body: {content[:300]!r}"
    if status == 200 and b'"type":"server_error"' in content:
        return f"200 carrying a server error: {content[-300:]!r}"
    return None


def test_fuzz_every_post_route_never_gets_a_5xx(tmp_path):
    model = build_tiny_chat_model(tmp_path)
    with serving(model, quiet_args()) as (_engine, address):
        schema = schemathesis.openapi.from_url(f"{address.url}/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        posts = [op for op in operations if op.method.upper() == "POST"]
        assert {op.path for op in posts} >= {
            "/v1/chat/completions",
            "/v1/completions",
            "/tokenize",
            "/detokenize",
            "/reset_prefix_cache",
        }
        # negative cases need something to break: an operation without a body has only positive ones
        cases = [
            case
            for op in posts
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 2 if len(op.body) else 1]
            for case in _collect(op, mode, CASES_PER_MODE)
        ]
        local = threading.local()

        def send(case: Any) -> str | None:
            if not hasattr(local, "session"):
                import requests

                local.session = requests.Session()
            try:
                response = case.call(base_url=address.url, session=local.session, timeout=120)
            except Exception as exc:  # a dropped connection is as bad as a 5xx
                return f"no answer: {type(exc).__name__}: {exc}"
            return _problem(case, response)

        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            problems = [
                f"{_describe(case)} -> {problem}"
                for case, problem in zip(cases, pool.map(send, cases), strict=True)
                if problem is not None
            ]
        elapsed = time.monotonic() - start
        with httpx.Client(base_url=address.url, timeout=30) as http:
            health = http.get("/health").status_code
    assert not problems, f"{len(problems)} of {len(cases)} cases failed:\n" + "\n".join(problems)
    assert len(cases) >= 500
    assert elapsed < BUDGET_S, f"{len(cases)} cases took {elapsed:.0f} s"
    assert health == 200
