"""One streaming OpenAI request, timed per content chunk (a black-box client: imports nothing from aserve).

`one_request` POSTs `build_body(spec, ...)` to `spec.path` with `stream: true` and
`stream_options.include_usage`, and never raises for a server's failure: the RequestResult says ok=False
with the error. TTFT is the first content chunk's time after sending; `chunk_times` holds every content
chunk's arrival, so `itls` are vLLM's inter-token latencies (one per chunk after the first) and `tpot` is
(e2e - ttft) / (output_tokens - 1). `output_tokens` (and `prompt_tokens`) come from the usage chunk when the
server sends one, else from the number of content chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

# guided_json: an open-ended list of records, so guided outputs, like unguided ones, tend to run to
# max_tokens (output tok/s is compared, so an early stop costs batch occupancy, not the metric)
GUIDED_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"},
                       "level": {"enum": ["low", "mid", "high"]}},
        "required": ["name", "score", "level"]}}},
    "required": ["records"],
}


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run shares: the endpoint path, chat or completions, sampling."""

    path: str = "/v1/completions"
    chat: bool = False
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    guided_json: bool = False


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_body(spec: RequestSpec, model: str, prompt: str, max_tokens: int | None = None) -> dict:
    """The JSON body: `max_tokens` overrides the spec's (per-request output lengths)."""
    body: dict = {
        "model": model,
        "max_tokens": spec.max_tokens if max_tokens is None else max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.guided_json:
        if spec.chat:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "records", "schema": GUIDED_SCHEMA}}
        else:
            body["guided_json"] = GUIDED_SCHEMA
    return body


def chunk_content(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def one_request(client: httpx.AsyncClient, spec: RequestSpec, model: str, prompt: str,
                      max_tokens: int | None = None) -> RequestResult:
    result = RequestResult(ok=False, start=time.perf_counter())
    chunks, text = 0, []
    usage: dict = {}
    finished = False  # some servers (transformers serve) end the stream without data: [DONE]
    try:
        async with client.stream("POST", spec.path, json=build_body(spec, model, prompt, max_tokens)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    result.error = f"bad SSE line {line[:80]!r}"
                    return result
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                usage = chunk.get("usage") or usage
                if any(c.get("finish_reason") for c in chunk.get("choices") or ()):
                    finished = True
                if content := chunk_content(chunk, spec.chat):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
                    text.append(content)
                    chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:  # vLLM's latency ends with the last content chunk (not the usage chunk or [DONE])
        result.e2e = (result.chunk_times[-1] if result.chunk_times else time.perf_counter()) - result.start
    result.output_tokens = usage.get("completion_tokens", chunks)
    result.prompt_tokens = usage.get("prompt_tokens")
    result.generated_text = "".join(text)
    if not result.ok and not result.error:
        if finished:
            result.ok = True
        else:
            result.error = "the stream ended without a finish_reason or data: [DONE]"
    return result


async def resolve_model(client: httpx.AsyncClient, model: str) -> str:
    """`model`, or the first id of GET /v1/models when it is empty."""
    if model:
        return model
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
