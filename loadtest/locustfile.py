"""Locust load test for any OpenAI-compatible server: users stream chat completions over SSE.

    locust -f loadtest/ --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s --max-tokens 64

Besides the whole-request entry ("chat.completions (stream)", timed to the last byte), every request
reports its own entries:
  * "time_to_first_token": request start -> first content chunk;
  * "time_per_output_token": mean gap between content chunks after the first (one per request);
  * "inter_token_latency": every gap between content chunks (disable with --no-itl-entries).

Options (flags, or the environment variables in brackets):
  --model [ASERVE_LT_MODEL]              default: the first id from GET /v1/models
  --max-tokens [ASERVE_LT_MAX_TOKENS]    default 64
  --prompt [ASERVE_LT_PROMPT]            a fixed prompt; default: synthetic prompts of --prompt-words words
  --prompt-words [ASERVE_LT_PROMPT_WORDS]  default 200
  --temperature [ASERVE_LT_TEMPERATURE]  default 0.0
  --ignore-eos [ASERVE_LT_IGNORE_EOS]    vLLM extension: always generate --max-tokens tokens
  --api-key [ASERVE_LT_API_KEY]          sent as a Bearer token
  --wait-min / --wait-max                seconds a user waits between requests (default 0 / 0.5)

It imports nothing from aserve: it is a black-box client.
"""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, events, task

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
).split()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("aserve load test")
    group.add_argument(
        "--model", default="", env_var="ASERVE_LT_MODEL", help="model name (default: first served)"
    )
    group.add_argument("--max-tokens", type=int, default=64, env_var="ASERVE_LT_MAX_TOKENS")
    group.add_argument("--prompt", default="", env_var="ASERVE_LT_PROMPT", help="a fixed prompt")
    group.add_argument("--prompt-words", type=int, default=200, env_var="ASERVE_LT_PROMPT_WORDS")
    group.add_argument("--temperature", type=float, default=0.0, env_var="ASERVE_LT_TEMPERATURE")
    group.add_argument("--ignore-eos", action="store_true", default=False, env_var="ASERVE_LT_IGNORE_EOS")
    group.add_argument("--api-key", default="", env_var="ASERVE_LT_API_KEY")
    group.add_argument(
        "--no-itl-entries",
        action="store_true",
        default=False,
        help="do not report every inter-token gap as its own entry",
    )
    group.add_argument("--wait-min", type=float, default=0.0)
    group.add_argument("--wait-max", type=float, default=0.5)


def synthetic_prompt(rng: random.Random, num_words: int) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(num_words))
    return f"Summarize the following notes in one paragraph: {words}"


def _fire(
    environment, name: str, seconds: float, length: int = 0, exception: Exception | None = None
) -> None:
    environment.events.request.fire(
        request_type="SSE",
        name=name,
        response_time=seconds * 1000.0,
        response_length=length,
        exception=exception,
        context={},
    )


class ChatStreamUser(HttpUser):
    """One user: a loop of streaming chat completions."""

    def wait_time(self):
        opts = self.environment.parsed_options
        return between(opts.wait_min, max(opts.wait_min, opts.wait_max))(self)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.rng = random.Random()
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.model = opts.model
        if not self.model:
            with self.client.get(
                "/v1/models", headers=self.headers, name="models", catch_response=True
            ) as resp:
                if resp.status_code != 200:
                    resp.failure(f"GET /v1/models: {resp.status_code}")
                    return
                self.model = resp.json()["data"][0]["id"]

    def _body(self) -> dict:
        opts = self.environment.parsed_options
        prompt = opts.prompt or synthetic_prompt(self.rng, opts.prompt_words)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": opts.max_tokens,
            "temperature": opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    @task
    def stream_chat(self) -> None:
        opts = self.environment.parsed_options
        start = time.perf_counter()
        first: float | None = None
        last = start
        gaps: list[float] = []
        num_chunks = 0
        completion_tokens = None
        with self.client.post(
            "/v1/chat/completions",
            json=self._body(),
            headers=self.headers,
            stream=True,
            catch_response=True,
            name="chat.completions (stream)",
        ) as resp:
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    return
                done = False
                for raw in resp.iter_lines():
                    if not raw:
                        continue
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data: "):
                        resp.failure(f"not an SSE data line: {line[:80]!r}")
                        return
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        resp.failure(f"error event: {chunk['error'].get('message')}")
                        return
                    if chunk.get("usage"):
                        completion_tokens = chunk["usage"].get("completion_tokens")
                    choices = chunk.get("choices") or []
                    if not choices or not (choices[0].get("delta") or {}).get("content"):
                        continue
                    now = time.perf_counter()
                    num_chunks += 1
                    if first is None:
                        first = now
                        _fire(self.environment, "time_to_first_token", now - start)
                    else:
                        gaps.append(now - last)
                        if not opts.no_itl_entries:
                            _fire(self.environment, "inter_token_latency", now - last)
                    last = now
                if not done:
                    resp.failure("the stream ended without data: [DONE]")
                    return
                if gaps:
                    _fire(self.environment, "time_per_output_token", sum(gaps) / len(gaps))
                resp.success()
            except Exception as exc:  # a broken stream is a failed request, not a crashed user
                resp.failure(f"{type(exc).__name__}: {exc}")
            finally:
                # Time the whole-request entry to the last byte (locust would stop at the headers).
                resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000.0
                resp.request_meta["response_length"] = completion_tokens or num_chunks
