"""OpenAI wire types as msgspec Structs (OpenAI field names), plus vLLM's extra sampling fields.

Requests forbid unknown fields, so a misspelt or unsupported option is a 400 naming it rather than
silently ignored. Limited request fields carry their range and meaning from
`aserve.sampling_params.LIMITS` as schema-only annotations (`/openapi.json` shows them; the values
are checked by SamplingParams, whose errors name the field in OpenAI's format). Response fields that
OpenAI omits are `UNSET` (msgspec leaves them out).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from aserve.sampling_params import LIMITS

# -- requests ---------------------------------------------------------------------------------------

Priority = Annotated[
    int,
    msgspec.Meta(
        ge=LIMITS["priority"].low, le=LIMITS["priority"].high, description=LIMITS["priority"].description
    ),
]
"""An int64 the engine passes on unchecked (decoding enforces the range); sampling fields are checked
by SamplingParams."""


def _limited(tp: Any, name: str, description: str | None = None) -> Any:
    """`tp` annotated, for the JSON schema only, with `LIMITS[name]`'s range and description."""
    limit = LIMITS[name]
    return Annotated[
        tp, msgspec.Meta(description=description or limit.description, extra_json_schema=limit.json_schema())
    ]


_OptFloat = float | None
_OptInt = int | None
FrequencyPenalty = _limited(_OptFloat, "frequency_penalty")
PresencePenalty = _limited(_OptFloat, "presence_penalty")
RepetitionPenalty = _limited(_OptFloat, "repetition_penalty")
Temperature = _limited(_OptFloat, "temperature")
TopP = _limited(_OptFloat, "top_p")
MinP = _limited(_OptFloat, "min_p")
TopK = _limited(_OptInt, "top_k")
N = _limited(_OptInt, "n")
BestOf = _limited(_OptInt, "best_of")
Seed = _limited(_OptInt, "seed")
MaxTokens = _limited(_OptInt, "max_tokens")
MaxCompletionTokens = _limited(
    _OptInt,
    "max_tokens",
    "The most tokens to generate (OpenAI's newer name for "
    "`max_tokens`, which it overrides); prompt + it must fit in `max_model_len`.",
)
MinTokens = _limited(int, "min_tokens")
Logprobs = _limited(_OptInt, "logprobs")
TopLogprobs = _limited(
    _OptInt,
    "logprobs",
    "With `logprobs: true`, also return this many most likely tokens "
    "at each position; the server caps it at `--max-logprobs` (default 20).",
)
PromptLogprobs = _limited(_OptInt, "prompt_logprobs")
TruncatePromptTokens = _limited(_OptInt, "truncate_prompt_tokens")
Stop = _limited(str | list[str] | None, "stop")
StopTokenIds = _limited(list[int] | None, "stop_token_ids")
LogitBias = _limited(dict[str, float] | None, "logit_bias")
Prompts = _limited(str | list[Any], "prompts")


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's: accepted; chunks never carry obfuscation padding


class _Part(Struct, tag_field="type", forbid_unknown_fields=True):
    """A content part; `type` picks the kind. Only text is served (others are a clear 400)."""


class TextPart(_Part, tag="text"):
    text: str


class RefusalPart(_Part, tag="refusal"):
    refusal: str


class ImageURL(Struct, forbid_unknown_fields=True):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Part, tag="image_url"):
    image_url: ImageURL


class InputAudio(Struct, forbid_unknown_fields=True):
    data: str
    format: str


class AudioPart(_Part, tag="input_audio"):
    input_audio: InputAudio


class FileRef(Struct, forbid_unknown_fields=True):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Part, tag="file"):
    file: FileRef


class MediaURL(Struct, forbid_unknown_fields=True):
    url: str


class AudioURLPart(_Part, tag="audio_url"):  # vLLM's
    audio_url: MediaURL


class VideoURLPart(_Part, tag="video_url"):  # vLLM's
    video_url: MediaURL


ContentPart = TextPart | RefusalPart | ImagePart | AudioPart | FilePart | AudioURLPart | VideoURLPart

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(Struct, forbid_unknown_fields=True):
    """A message as OpenAI's (and vLLM's) chat API accepts it; an unknown key is a 400 naming it.

    `refusal`, `audio`, `function_call` and `annotations` are the fields an assistant message that
    a client sends back carries; null or empty they mean nothing, otherwise chat refuses them.
    """

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # vLLM's: handed to the chat template
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None


class _SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and completions requests (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    frequency_penalty: FrequencyPenalty = None
    presence_penalty: PresencePenalty = None
    logit_bias: LogitBias = None
    n: N = 1
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = None
    top_p: TopP = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0
    echo: bool | None = False
    # structured outputs: OpenAI's response_format and vLLM's guided_* / structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # qualified names (or {"qualname", "args", "kwargs"}) matching --logits-processor-pattern
    logits_processors: list[str | dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    logprobs: Annotated[
        bool | None, msgspec.Meta(description="Return the log probability of each output token.")
    ] = False
    top_logprobs: TopLogprobs = None
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxCompletionTokens = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # The rest of OpenAI's chat request (README: "OpenAI request fields"). Served: reasoning_effort (the
    # chat template's `reasoning_effort` variable). Accepted and ignored, as they change nothing an
    # answer here could show: store (nothing is stored), metadata (kept only with store), service_tier
    # (one tier), prompt_cache_key / prompt_cache_retention (prefix caching is automatic), safety_identifier,
    # verbosity (a hint to OpenAI's own models), prediction (predicted outputs only speed OpenAI up).
    # Refused by name (`chat._reject_unsupported`): audio output, web search, the legacy functions API.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # chat templating (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec cannot union several array types,
    # so the list forms are checked by `completions.normalize_prompts`.
    prompt: Prompts
    best_of: BestOf = None
    logprobs: Logprobs = None
    max_tokens: MaxTokens = 16
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_logprobs: PromptLogprobs = None


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Either `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


# -- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET  # with --enable-prompt-tokens-details


class ChatTopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprobEntry]


class ChatResponseMessage(Struct):
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)
    reasoning_content: str | None | UnsetType = UNSET  # with --reasoning-parser (vLLM's field)


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class DeltaMessage(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: UsageInfo | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None | UnsetType = UNSET
    prompt_logprobs: list[dict[str, float] | None] | UnsetType = UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageInfo | None | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "aserve"
    parent: str | None = None
    permission: list[dict[str, Any]] = msgspec.field(default_factory=list)
    task: str = "generate"  # what the model serves (--task): "generate", "embed", "classify", "score", "encode"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


encoder = msgspec.json.Encoder()
"""One shared, stateless encoder (msgspec encoders are safe to reuse)."""
