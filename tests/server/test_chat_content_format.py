"""--chat-template-content-format (vLLM's): how message content reaches the chat template."""

from __future__ import annotations

import msgspec
import pytest

from aserve.server.args import parse_args
from aserve.server.chat import to_conversation
from aserve.server.chat_template import ChatRenderer, ResolvedTemplate
from aserve.server.errors import APIError
from aserve.server.protocol import ChatMessage

# Shows which form it got: a string is printed as S(...), a list of parts as P(...) per part.
TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}S({{ m.content }}){% else %}"
            "{% for p in m.content %}P({{ p.type }}={{ p.text }}){% endfor %}{% endif %};{% endfor %}")


class _Tok:
    bos_token, eos_token, chat_template = "<s>", "</s>", None

    def get_vocab(self):
        return {}


def _messages() -> list[ChatMessage]:
    raw = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    return msgspec.convert(raw, list[ChatMessage])


def _render(content_format: str, **kwargs) -> str:
    renderer = ChatRenderer(_Tok(), ResolvedTemplate("test", TEMPLATE))
    return renderer.render(to_conversation(_messages(), content_format), add_generation_prompt=False, **kwargs)


def test_string_and_auto_flatten_parts_openai_passes_the_list():
    assert _render("string") == "system:S(Be brief.);user:S(one\ntwo);"
    assert _render("auto") == _render("string")  # aserve's auto: what it always did
    assert _render("openai") == "system:P(text=Be brief.);user:P(text=one)P(text=two);"
    # continue_final_message finds the final message's text in either form
    assert _render("openai", continue_final_message=True) == "system:P(text=Be brief.);user:P(text=one)P(text=two"


def test_openai_form_still_refuses_non_text_parts():
    message = msgspec.convert([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], list[ChatMessage])
    with pytest.raises(APIError):
        to_conversation(message, "openai")


def test_the_flag_reaches_the_server_args():
    assert parse_args([])[1].chat_template_content_format == "auto"
    assert parse_args(["--chat-template-content-format", "openai"])[1].chat_template_content_format == "openai"
    with pytest.raises(SystemExit):
        parse_args(["--chat-template-content-format", "xml"])
