"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app's exception handlers turn it (and decoding, sampling-parameter
and routing errors) into a JSON response. A client's mistake is always a 4xx, never a 500.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import TypeVar

import msgspec
from starlette.responses import Response

from aserve.sampling_params import SamplingParamsError
from aserve.server.protocol import ErrorInfo, ErrorResponse, encoder

T = TypeVar("T")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered in OpenAI's format with HTTP `status`; `param` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def to_bytes(self) -> bytes:
        return encoder.encode(ErrorResponse(error=self.info()))

    def to_response(self) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return Response(
            self.to_bytes(), status_code=self.status, media_type="application/json", headers=headers
        )


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> APIError:
    extra = f": {detail}" if detail else ""
    return APIError(
        400, f"`{param}` is not supported by this server{extra}", param=param, code="unsupported_parameter"
    )


_PATH_RE = re.compile(r"at `\$(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<name>[^`]+)`")
_MISSING_RE = re.compile(r"missing required field `(?P<name>[^`]+)`")


def _param_from_path(path: str) -> str | None:
    path = path.lstrip(".")
    return path or None


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    """Map msgspec's "Expected `int`, got `str` - at `$.n`" to a 400 whose `param` is `n`."""
    text = str(exc)
    match = _PATH_RE.search(text)
    param = _param_from_path(match.group("path")) if match else None
    for regex in (_UNKNOWN_RE, _MISSING_RE):
        named = regex.search(text)
        if named:
            param = f"{param}.{named.group('name')}" if param else named.group("name")
            break
    if _UNKNOWN_RE.search(text):
        message = f"{text} (unknown or unsupported field)"
        return APIError(400, message, param=param, code="unknown_field")
    return APIError(400, text, param=param, code="invalid_type")


def from_sampling_error(exc: SamplingParamsError) -> APIError:
    return APIError(400, str(exc), param=exc.field, code="invalid_value")


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a request body; malformed JSON or a bad field is a 400."""
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from None


def http_error(status: int, detail: str | None = None) -> APIError:
    """An APIError for a routing-level status (404 unknown path, 405 wrong method, ...)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    return APIError(status, detail or phrase, code=phrase.lower().replace(" ", "_"))


def engine_failure(exc: BaseException) -> APIError:
    """The engine failed while generating (it died, or a step raised): a 500, not the client's fault."""
    return APIError(
        500, f"the engine failed while generating: {type(exc).__name__}: {exc}", code="engine_error"
    )
