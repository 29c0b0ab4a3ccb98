"""Fuzzing every POST route against a live server on the real engine (tiny random model).

`test_fuzz_every_post_route_never_gets_a_5xx`: schemathesis cases from the server's own
/openapi.json (Hypothesis strategies, positive and negative, derandomized so every run sends the
same inputs), sent 8 at a time so the engine batches them. Random whole bodies rarely pass intake
with one extreme number in them, so `test_every_numeric_field_at_its_extremes` also sends a valid
request with one numeric field (found in the same document) set to each of a list of extremes;
those that pass intake reach the runner. No answer may be a 5xx (nor a 200 stream carrying a
server error), every 4xx must be an OpenAI error body, and /health must answer 200 afterwards.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest

# the test extra installs it; elsewhere (the GPU image) the module skips, naming it
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402
from tests.server.real_tiny_server import build_tiny_chat_model, serving  # noqa: E402
from tests.server.server_harness import quiet_args  # noqa: E402

from aserve.server.protocol import ErrorResponse  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# Per POST operation with a body, for each of positive and negative generation; CI sends 20 (about
# 160 requests), `ASERVE_FUZZ_CASES=300` a fifteen times deeper run.
CASES_PER_MODE = int(os.environ.get("ASERVE_FUZZ_CASES", "20"))
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
    if isinstance(case.body, NotSet):
        return f"{case.method} {case.path} (no body)"
    body = case.body if not isinstance(case.body, bytes) else case.body[:300]
    try:
        shown = json.dumps(body, ensure_ascii=True)[:600]
    except (TypeError, ValueError):
        shown = repr(body)[:600]
    return f"{case.method} {case.path} media_type={case.media_type} body={shown}"


def _problem(status: int, content: bytes) -> str | None:
    """What is wrong with this answer (None: nothing)."""
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


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    with serving(model, quiet_args()) as (_engine, address):
        yield address


def _send_all(requests_: list[Any], send_one: Any) -> tuple[list[str], float]:
    """Send every request 8 at a time; returns the problems found and the seconds it took."""
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        problems = [p for p in pool.map(send_one, requests_) if p is not None]
    return problems, time.monotonic() - start


def _health(address: Any) -> int:
    with httpx.Client(base_url=address.url, timeout=30) as http:
        return http.get("/health").status_code


def test_fuzz_every_post_route_never_gets_a_5xx(live):
    address = live
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
            return f"{_describe(case)} -> no answer: {type(exc).__name__}: {exc}"
        problem = _problem(response.status_code, response.content)
        return None if problem is None else f"{_describe(case)} -> {problem}"

    problems, elapsed = _send_all(cases, send)
    health = _health(address)
    assert not problems, f"{len(problems)} of {len(cases)} cases failed:\n" + "\n".join(problems)
    assert len(cases) >= 6 * CASES_PER_MODE  # about 8 per POST route and mode, less duplicates
    assert elapsed < BUDGET_S, f"{len(cases)} cases took {elapsed:.0f} s"
    assert health == 200


INT_EXTREMES = [-1, 0, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**70, -(2**70)]
FLOAT_EXTREMES = [-0.0, 5e-324, 1e-300, 3.5e38, 1e308, -1e308, 2.0**70]
BASES = {
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [5, 6]},
}


def _numeric_kind(prop: dict[str, Any]) -> tuple[str, str] | None:
    """("scalar" | "list" | "map", "integer" | "number") for a numeric property, else None."""
    for option in prop.get("anyOf", [prop]):
        kind = option.get("type")
        if kind in ("integer", "number"):
            return "scalar", kind
        if kind == "array" and option.get("items", {}).get("type") in ("integer", "number"):
            return "list", option["items"]["type"]
        if kind == "object" and option.get("additionalProperties", {}).get("type") in ("integer", "number"):
            return "map", option["additionalProperties"]["type"]
    return None


def _extreme_bodies(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    bodies = []
    for path, base in BASES.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]["properties"]
        for name, prop in props.items():
            numeric = _numeric_kind(prop)
            if numeric is None:
                continue
            shape, kind = numeric
            values = INT_EXTREMES if kind == "integer" else FLOAT_EXTREMES + INT_EXTREMES
            for value in values:
                wrapped = {"scalar": value, "list": [value], "map": {"5": value}}[shape]
                bodies.append((path, {**base, name: wrapped}))
            if shape == "map":  # token-id keys, e.g. logit_bias
                bodies += [(path, {**base, name: {str(v): 1.0}}) for v in INT_EXTREMES]
    return bodies


def test_every_numeric_field_at_its_extremes(live):
    address = live
    with httpx.Client(base_url=address.url, timeout=30) as http:
        bodies = _extreme_bodies(http.get("/openapi.json").json())
    assert len(bodies) > 300
    local = threading.local()

    def send(item: tuple[str, dict[str, Any]]) -> str | None:
        path, body = item
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=address.url, timeout=120)
        try:
            r = local.http.post(path, content=json.dumps(body))
        except httpx.HTTPError as exc:
            return f"POST {path} {json.dumps(body)} -> no answer: {type(exc).__name__}: {exc}"
        problem = _problem(r.status_code, r.content)
        return None if problem is None else f"POST {path} {json.dumps(body)} -> {problem}"

    problems, elapsed = _send_all(bodies, send)
    health = _health(address)
    assert not problems, f"{len(problems)} of {len(bodies)} requests failed:\n" + "\n".join(problems)
    assert elapsed < BUDGET_S
    assert health == 200
