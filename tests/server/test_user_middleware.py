"""`--middleware`: user ASGI middleware classes and `async def f(request, call_next)` functions run in
the order given on a real server; an unimportable or unusable path fails at start-up naming the flag."""

from __future__ import annotations

import httpx
import pytest

from aserve.server.args import parse_args, validate_server_args
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)
SELF = "tests.server.test_user_middleware"


class TagHeader:
    """An ASGI middleware class: adds `x-order: class` to every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-order", b"class"))
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    """HTTP middleware: adds `x-order: function` to the response."""
    response = await call_next(request)
    response.headers.append("x-order", "function")
    return response


NOT_MIDDLEWARE = 42


def test_middleware_runs_in_order_on_a_live_server(tmp_path):
    model = build_tiny_chat_model(tmp_path / "tiny")
    args = quiet_args(middleware=(f"{SELF}.TagHeader", f"{SELF}.tag_function"))
    with serving(model, args) as (_, address):
        r = httpx.get(f"{address.url}/v1/models")
        body = httpx.post(f"{address.url}/v1/completions",
                          json={"model": r.json()["data"][0]["id"], "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and body.status_code == 200
    # The first given is outermost: the function's header is added first, the class's on the way out.
    assert r.headers.get_list("x-order") == ["function", "class"]
    assert body.headers.get_list("x-order") == ["function", "class"]


def test_cli_collects_the_flag_in_order():
    _, server = parse_args(["--middleware", f"{SELF}.TagHeader", "--middleware", f"{SELF}.tag_function"])
    assert server.middleware == (f"{SELF}.TagHeader", f"{SELF}.tag_function")


@pytest.mark.parametrize("path, why", [("no.such.module.Thing", "cannot import"),
                                       (f"{SELF}.Missing", "cannot import"),
                                       (f"{SELF}.NOT_MIDDLEWARE", "neither an ASGI middleware class")])
def test_bad_paths_fail_at_start_up_naming_the_flag(path, why, capsys):
    with pytest.raises(ValueError, match=f"--middleware: .*{why}"):
        validate_server_args(quiet_args(middleware=(path,)))
    with pytest.raises(SystemExit) as exc:
        parse_args(["--middleware", path])
    assert exc.value.code == 2 and "--middleware" in capsys.readouterr().err
