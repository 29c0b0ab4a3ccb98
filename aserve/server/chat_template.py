"""Chat templates: resolution at start-up and sandboxed rendering + tokenization per request.

Resolution order: `--chat-template` (a file path or an inline template), the tokenizer's own
template, then a bundled template from `aserve.templates` chosen by the tokenizer's special tokens
(ChatML for `<|im_start|>`, Llama-3 for `<|start_header_id|>`, Mistral for `[INST]`). A model with
none of these gets a clear 400 on its first chat request. A request may bring its own
`chat_template`; it is rendered in the same sandbox.

Rendering and tokenizing are blocking; callers run `render_and_tokenize` in a worker thread.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from aserve.config import ConfigError
from aserve.server.errors import APIError, bad_request
from aserve.server.mistral_chat import is_mistral_tokenizer, render_mistral

BUNDLED_TEMPLATES = (
    ("<|im_start|>", "chatml.jinja"),
    ("<|start_header_id|>", "llama3.jinja"),
    ("[INST]", "mistral.jinja"),
)
_MAX_COMPILED = 32
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})


@dataclass(frozen=True)
class ResolvedTemplate:
    """The server's default template and where it came from ("flag", "tokenizer", "bundled:<file>")."""

    source: str
    template: str


def load_bundled_template(name: str) -> str:
    return resources.files("aserve.templates").joinpath(name).read_text(encoding="utf-8")


def _looks_like_template(text: str) -> bool:
    return "{{" in text or "{%" in text


def load_flag_template(value: str) -> str:
    """`--chat-template` is a readable file or an inline jinja template; anything else is a ConfigError."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if _looks_like_template(value):
        # A template typed on a command line often carries literal "\n" escapes.
        return value.replace("\\n", "\n") if "\n" not in value else value
    raise ConfigError(f"--chat-template: {value!r} is neither a readable file nor a jinja template")


def _tokenizer_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def detect_bundled_template(tokenizer: Any) -> str | None:
    """The bundled template file fitting the tokenizer's special tokens, or None."""
    vocab = tokenizer.get_vocab()
    for token, name in BUNDLED_TEMPLATES:
        if token in vocab:
            return name
    return None


def resolve_chat_template(tokenizer: Any, flag_value: str | None) -> ResolvedTemplate | None:
    if flag_value:
        return ResolvedTemplate("flag", load_flag_template(flag_value))
    own = _tokenizer_template(tokenizer)
    if own is not None:
        return ResolvedTemplate("tokenizer", own)
    name = detect_bundled_template(tokenizer)
    if name is not None:
        return ResolvedTemplate(f"bundled:{name}", load_bundled_template(name))
    return None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    out = {}
    for name in names:
        value = getattr(tokenizer, name, None)
        out[name] = value if isinstance(value, str) else ""
    return out


class ChatRenderer:
    """Renders conversations with a sandboxed jinja2 environment and tokenizes the result.

    Thread-safe: compiled templates are cached (bounded) and rendering keeps no state.
    """

    def __init__(self, tokenizer: Any, default: ResolvedTemplate | None):
        self.tokenizer = tokenizer
        self.default = default
        self._env = make_environment()
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._special = _special_tokens(tokenizer)
        self.mistral = is_mistral_tokenizer(tokenizer)  # --tokenizer-mode mistral: mistral_common encodes chats

    def _compile(self, source: str) -> jinja2.Template:
        template = self._compiled.get(source)
        if template is None:
            try:
                template = self._env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise bad_request(
                    f"the chat template has a syntax error: {exc}",
                    param="chat_template",
                    code="invalid_chat_template",
                ) from None
            self._compiled[source] = template
            while len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        return template

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `conversation`; raises APIError(400) naming the field on bad input.

        `tools` go to the template; a template that does not mention `tools` (SmolLM2's) gets them
        as a hermes-style system block instead, and one that does not mention `tool_calls` sees
        earlier assistant calls as `<tool_call>` text and tool results as `<tool_response>` text."""
        if add_generation_prompt and continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        source = chat_template or (self.default.template if self.default else None)
        if source is None:
            raise APIError(
                400,
                "this model has no chat template (none in its tokenizer config and no "
                "--chat-template given, and no bundled template fits its tokenizer); start the "
                "server with --chat-template or pass `chat_template` in the request",
                param="chat_template",
                code="no_chat_template",
            )
        conversation = _with_tools_as_text(conversation, tools, source)
        kwargs = dict(chat_template_kwargs or {})
        reserved = _RESERVED_KWARGS & kwargs.keys()
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs"
            )
        context = {
            **self._special,
            **kwargs,
            "messages": conversation,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "tools": tools or None,
        }
        try:
            text = self._compile(source).render(**context)
        except APIError:
            raise
        except jinja2.TemplateError as exc:
            raise bad_request(
                f"chat template error: {exc}", param="messages", code="chat_template_error"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise bad_request(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                param="messages",
                code="chat_template_error",
            ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, conversation)
        return text

    def render_and_tokenize(
        self, conversation: list[dict[str, Any]], *, add_special_tokens: bool = False, **render_kwargs: Any
    ) -> tuple[str, list[int]]:
        if self.mistral:
            return render_mistral(self.tokenizer, conversation, **render_kwargs)
        text = self.render(conversation, **render_kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


CONTENT_FORMATS = ("auto", "string", "openai")


def content_text(content: Any) -> str:
    """A message's text: a string as is, an OpenAI list of parts ("openai" content format) joined with
    newlines, as the "string" format joins them; None is ""."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _with_tools_as_text(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        source: str) -> list[dict[str, Any]]:
    """`conversation` rewritten for a template that does not render tools or tool calls."""
    from aserve.server.tool_parsers import hermes_tool_calls_text, with_tools_system_prompt

    if tools and "tools" not in source:
        conversation = with_tools_system_prompt(conversation, tools)
    if "tool_calls" not in source and any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation):
        rewritten = []
        for m in conversation:
            if m.get("tool_calls"):
                calls = hermes_tool_calls_text(m["tool_calls"])
                text = content_text(m.get("content"))
                m = {**{k: v for k, v in m.items() if k != "tool_calls"},
                     "content": f"{text}\n{calls}" if text else calls}
            elif m.get("role") == "tool":
                m = {**m, "content": f"<tool_response>\n{content_text(m.get('content'))}\n</tool_response>"}
            rewritten.append(m)
        conversation = rewritten
    return conversation


def _cut_after_final_message(text: str, conversation: list[dict[str, Any]]) -> str:
    final = conversation[-1].get("content") if conversation else None
    if isinstance(final, list):  # the last text part, as transformers' apply_chat_template
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str) or not final.strip():
        raise bad_request(
            "continue_final_message needs a final message with text content", param="continue_final_message"
        )
    for needle in (final, final.strip()):
        idx = text.rfind(needle)
        if idx >= 0:
            return text[: idx + len(needle)]
    raise bad_request(
        "continue_final_message: the final message's text does not appear in the rendered template",
        param="continue_final_message",
    )
