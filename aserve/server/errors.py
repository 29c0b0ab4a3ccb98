"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app's exception handlers turn it (and decoding, sampling-parameter
and routing errors) into a JSON response. A client's mistake is always a 4xx, never a 500.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response

from aserve.outputs import RequestError
from aserve.sampling_params import MAX_JSON_DEPTH, SamplingParamsError
from aserve.server.protocol import ErrorInfo, ErrorResponse, encoder

T = TypeVar("T")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
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
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")
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
        return Response(
            self.to_bytes(), status_code=self.status, media_type="application/json", headers=self.headers
        )


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: int) -> APIError:
    """A 429 for a request over an admission cap: the client should retry after `retry_after_s`."""
    return APIError(429, message, code="queue_full", headers={"Retry-After": str(retry_after_s)})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                    code="request_too_large")


def timed_out(timeout_s: float) -> APIError:
    """A 504 (or, once a stream has started, its error event) for a request aborted at its deadline."""
    message = f"the request did not finish within {timeout_s:g} s (--request-timeout) and was aborted"
    return APIError(504, message, code="timeout")


def unsupported(param: str, detail: str = "") -> APIError:
    extra = f": {detail}" if detail else ""
    return APIError(
        400, f"`{param}` is not supported by this server{extra}", param=param, code="unsupported_parameter"
    )


_PATH_RE = re.compile(r"at `\$(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<name>[^`]+)`")
_MISSING_RE = re.compile(r"missing required field `(?P<name>[^`]+)`")


def _param_from_path(path: str) -> str | None:
    """"$.messages[0].content" -> "messages[0].content"; a dict value ("$.logit_bias[...]") names the dict."""
    path = path.replace("[...]", "").lstrip(".")
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


def from_sampling_error(exc: SamplingParamsError, fields: Mapping[str, str] | None = None) -> APIError:
    """A 400 for an intake error; `fields` maps SamplingParams' field names to the request's
    (chat: "prompt" -> "messages", "logprobs" -> "top_logprobs", ...)."""
    param = (fields or {}).get(exc.field, exc.field)
    return APIError(400, f"{param}: {exc.message}", param=param, code=exc.code)


@contextmanager
def sampling_errors_as_400(fields: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turns a SamplingParamsError raised inside the block into a 400 naming the request's field."""
    try:
        yield
    except SamplingParamsError as exc:
        raise from_sampling_error(exc, fields) from None


class _BadValue(Exception):
    def __init__(self, key: str | None):
        self.key = key


_NOT_A_NUMBER = object()  # stands for NaN / Infinity / -Infinity while locating the field


def _is_bad(value: Any) -> bool:
    if value is _NOT_A_NUMBER:
        return True
    if isinstance(value, str):
        return any("\udc80" <= ch <= "\udcff" for ch in value)  # undecodable bytes (surrogateescape)
    if isinstance(value, list):
        return any(v is _NOT_A_NUMBER or (isinstance(v, str) and _is_bad(v)) for v in value)
    return False


def _check_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in pairs:
        if _is_bad(key):
            raise _BadValue(None)  # a key that is not text names no field
        if _is_bad(value):
            raise _BadValue(key)
    return dict(pairs)


def _locate_bad_value(body: bytes) -> str | None:
    """The key holding an undecodable string or a NaN/Infinity literal, or None (slow path: errors only)."""
    text = body.decode("utf-8", "surrogateescape")
    try:
        json.loads(text, object_pairs_hook=_check_pairs, parse_constant=lambda _: _NOT_A_NUMBER)
    except _BadValue as found:
        return found.key
    except (ValueError, RecursionError):
        return None
    return None


def _too_deep(value: Any, limit: int) -> str | None:
    """The top-level field whose value nests arrays/objects deeper than `limit` (the body is level 1)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, msgspec.Struct):
            children: Iterable[tuple[str, Any]] = ((f, getattr(item, f)) for f in item.__struct_fields__)
        elif isinstance(item, dict):
            children = ((field, v) for v in item.values())
        elif isinstance(item, list):
            children = ((field, v) for v in item)
        else:
            continue
        if depth > limit:
            return field or None
        for name, child in children:
            if isinstance(child, list | dict | msgspec.Struct):
                stack.append((child, depth + 1, field or name))
    return None


def _too_deep_error(param: str | None) -> APIError:
    return APIError(400, f"the request nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
                    param=param, code="too_deep")


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a request body; anything but a well-formed JSON object of the expected shape is a 400
    (malformed or non-UTF-8 bytes, NaN/Infinity literals, wrong types, unknown fields, nesting deeper
    than MAX_JSON_DEPTH)."""
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        param = _locate_bad_value(body)
        if param is not None:
            raise APIError(400, f"{param}: NaN and Infinity are not valid JSON numbers", param=param,
                           code="invalid_json") from None
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    except UnicodeDecodeError as exc:
        param = _locate_bad_value(body)
        where = f" (in `{param}`)" if param else ""
        raise APIError(400, f"the request body is not valid UTF-8{where}: {exc.reason} at byte {exc.start}",
                       param=param, code="invalid_encoding") from None
    except RecursionError:
        raise _too_deep_error(None) from None
    deep = _too_deep(value, MAX_JSON_DEPTH)
    if deep is not None:
        raise _too_deep_error(deep)
    return value


def http_error(status: int, detail: str | None = None) -> APIError:
    """An APIError for a routing-level status (404 unknown path, 405 wrong method, ...)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    return APIError(status, detail or phrase, code=phrase.lower().replace(" ", "_"))


class RequestFailed(Exception):
    """The engine failed this request alone (`RequestOutput.error`); everyone else carries on."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.error = error


def engine_failure(exc: BaseException) -> APIError:
    """What a generation failure becomes: a request that failed alone is a 400 when its input was at
    fault (else a 500 for it only); the engine itself failing (it died) is a 500."""
    if isinstance(exc, RequestFailed):
        if exc.error.bad_input:
            return APIError(400, f"the request failed: {exc.error.message}", code="invalid_request")
        return APIError(500, f"the request failed: {exc.error.message}", code="request_failed")
    return APIError(
        500, f"the engine failed while generating: {type(exc).__name__}: {exc}", code="engine_error"
    )
