"""The OpenAPI 3.1 document (`/openapi.json`) and the `/docs` page, built from the route table.

The app lists its routes once, as `Operation`s (method, path, handler, request and response types);
`create_app` turns that one list into starlette routes and, through `openapi_document`, into the
OpenAPI document, so the two cannot drift apart. Schemas come from the msgspec structs in
`aserve.server.protocol` (`msgspec.json.schema_components`, JSON Schema 2020-12, which OpenAPI 3.1
uses as is). A struct that forbids unknown fields gets `additionalProperties: false`, as the
server answers such a field with a 400.

Every operation documents its 200 body (a JSON schema, or text for /metrics), the streamed form
(`text/event-stream` of `data: <chunk JSON>` lines) where `stream: true` is accepted, and the OpenAI
error body for 4XX and 5XX answers. `/docs` is a self-contained HTML page (no script, no CDN: the
server may run without internet access) listing each operation and its schemas.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from aserve.server.protocol import ErrorResponse

_REF = "#/components/schemas/{name}"
_ERROR_REF = "#/components/responses/Error"


@dataclass(frozen=True)
class Operation:
    """One route: `endpoint` answers `method path`.

    `request` is the JSON body's type (None: no body); `response` the 200 JSON body's type (None: an
    empty 200, or `text_response` for a text body); `stream_chunk` the type of the SSE chunks sent
    when the request asks for `stream: true`.
    """

    method: str
    path: str
    endpoint: Callable[..., Any]
    summary: str
    request: Any = None
    response: Any = None
    stream_chunk: Any = None
    text_response: str | None = None


def _structs(types: Iterable[Any]) -> dict[str, bool]:
    """Every msgspec struct reachable from `types`: class name -> forbids unknown fields."""
    found: dict[str, bool] = {}
    stack = list(msgspec.inspect.multi_type_info(list(types)))
    seen: set[int] = set()
    while stack:
        info = stack.pop()
        if id(info) in seen:
            continue
        seen.add(id(info))
        if isinstance(info, msgspec.inspect.StructType):
            if info.cls.__name__ in found:
                continue
            found[info.cls.__name__] = bool(info.forbid_unknown_fields)
            stack.extend(f.type for f in info.fields)
        elif isinstance(info, msgspec.inspect.UnionType):
            stack.extend(info.types)
        elif isinstance(info, msgspec.inspect.TupleType):
            stack.extend(info.item_types)
        elif isinstance(info, msgspec.inspect.DictType):
            stack.extend((info.key_type, info.value_type))
        elif hasattr(info, "item_type"):  # list, set, frozenset, variable-length tuple
            stack.append(info.item_type)
    return found


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation_object(op: Operation, schema_of: dict[Any, dict[str, Any]], secured: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK"}
    if op.response is not None:
        ok["content"] = _json_content(schema_of[op.response])
    elif op.text_response is not None:
        ok["content"] = {op.text_response: {"schema": {"type": "string"}}}
    if op.stream_chunk is not None:
        name = op.stream_chunk.__name__
        ok.setdefault("content", {})["text/event-stream"] = {
            "schema": {
                "type": "string",
                "description": f"with `stream: true`: `data: <{name} JSON>` events, ending with "
                "`data: [DONE]`",
            }
        }
        ok["description"] = f"OK (with `stream: true`, server-sent events of {name})"
    obj: dict[str, Any] = {
        "operationId": op.endpoint.__name__,
        "summary": op.summary,
        "responses": {"200": ok, "4XX": {"$ref": _ERROR_REF}, "5XX": {"$ref": _ERROR_REF}},
    }
    if op.request is not None:
        obj["requestBody"] = {"required": True, "content": _json_content(schema_of[op.request])}
    if secured:
        obj["security"] = [{"bearer": []}]
    return obj


def openapi_document(
    operations: Iterable[Operation],
    *,
    title: str,
    version: str,
    root_path: str = "",
    requires_key: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for `operations`.

    `requires_key(path)` says which paths need `Authorization: Bearer <key>` (None: no key is set);
    `root_path` becomes the server URL when the app is served under a path prefix.
    """
    operations = list(operations)
    types = [ErrorResponse]
    for op in operations:
        types += [t for t in (op.request, op.response, op.stream_chunk) if t is not None]
    types = list(dict.fromkeys(types))
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    for name, forbids in _structs(types).items():
        if forbids and name in components:
            components[name]["additionalProperties"] = False
    schema_of = dict(zip(types, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        secured = requires_key is not None and requires_key(op.path)
        paths.setdefault(op.path, {})[op.method.lower()] = _operation_object(op, schema_of, secured)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "responses": {
                "Error": {
                    "description": "an error in OpenAI's format",
                    "content": _json_content(schema_of[ErrorResponse]),
                }
            },
        },
    }
    if root_path:
        doc["servers"] = [{"url": root_path}]
    if requires_key is not None:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def docs_page(doc: dict[str, Any]) -> str:
    """A self-contained HTML page describing `doc`: each operation, then each schema as JSON."""
    esc = html.escape
    info = doc["info"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(info['title'])} API</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "pre{background:#f4f4f4;padding:.6em;overflow:auto}code{background:#f4f4f4}"
        ".m{font-weight:bold;display:inline-block;width:4em}</style></head><body>",
        f"<h1>{esc(info['title'])} {esc(info['version'])}</h1>",
        "<p>The machine-readable description is <a href='openapi.json'>openapi.json</a>.</p>",
        "<h2>Operations</h2>",
    ]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            parts.append(
                f"<h3 id='{esc(op['operationId'])}'><span class='m'>{esc(method.upper())}</span>"
                f"<code>{esc(path)}</code></h3><p>{esc(op['summary'])}</p><ul>"
            )
            if "security" in op:
                parts.append("<li>needs <code>Authorization: Bearer &lt;key&gt;</code></li>")
            if "requestBody" in op:
                parts.append(f"<li>request body: {_schema_link(op['requestBody']['content'])}</li>")
            ok = op["responses"]["200"]
            for media, body in ok.get("content", {}).items():
                parts.append(f"<li>200 <code>{esc(media)}</code>: {_schema_link({media: body})}</li>")
            if "content" not in ok:
                parts.append("<li>200 with an empty body</li>")
            parts.append("<li>4XX / 5XX: <a href='#ErrorResponse'>ErrorResponse</a></li></ul>")
    parts.append("<h2>Schemas</h2>")
    for name, schema in doc["components"]["schemas"].items():
        parts.append(
            f"<h3 id='{esc(name)}'>{esc(name)}</h3><pre>{esc(json.dumps(schema, indent=2))}</pre>"
        )
    parts.append("</body></html>")
    return "".join(parts)


def _schema_link(content: dict[str, Any]) -> str:
    schema = next(iter(content.values()))["schema"]
    ref = schema.get("$ref", "")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        return f"<a href='#{html.escape(name)}'>{html.escape(name)}</a>"
    return f"<code>{html.escape(json.dumps(schema))}</code>"
