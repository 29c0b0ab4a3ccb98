"""Chat template resolution, the bundled templates, and the sandbox."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError
from aserve.server.chat_template import (
    ChatRenderer,
    ResolvedTemplate,
    detect_bundled_template,
    load_bundled_template,
    load_flag_template,
    resolve_chat_template,
)
from aserve.server.errors import APIError

CONVERSATION = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


class _Tok:
    """Just enough tokenizer for template resolution and rendering."""

    def __init__(self, vocab, chat_template=None, bos="<s>", eos="</s>"):
        self._vocab = {t: i for i, t in enumerate(vocab)}
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos, eos

    def get_vocab(self):
        return self._vocab


def render(template_name: str, conversation=CONVERSATION, **kwargs) -> str:
    tok = _Tok([], bos="<BOS>", eos="<EOS>")
    return ChatRenderer(tok, ResolvedTemplate("test", load_bundled_template(template_name))).render(
        conversation, **kwargs
    )


def test_chatml():
    assert render("chatml.jinja") == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not render("chatml.jinja", add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_llama3():
    assert render("llama3.jinja") == (
        "<BOS><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    tool = render("llama3.jinja", [{"role": "tool", "content": "42"}], add_generation_prompt=False)
    assert tool == "<BOS><|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"


def test_mistral():
    assert render("mistral.jinja") == "<BOS>[INST] Be kind.\n\nHi [/INST] Hello!<EOS>[INST] Bye [/INST]"
    with pytest.raises(APIError) as info:
        render("mistral.jinja", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.status == 400 and "alternate" in info.value.message and info.value.param == "messages"


def test_bundled_template_detection():
    assert detect_bundled_template(_Tok(["a", "<|im_start|>"])) == "chatml.jinja"
    assert detect_bundled_template(_Tok(["<|start_header_id|>", "<|eot_id|>"])) == "llama3.jinja"
    assert detect_bundled_template(_Tok(["[INST]", "[/INST]"])) == "mistral.jinja"
    assert detect_bundled_template(_Tok(["a", "b"])) is None


def test_resolution_order(tmp_path):
    own = "{{ 'own' }}"
    tok = _Tok(["<|im_start|>"], chat_template=own)
    assert resolve_chat_template(tok, None) == ResolvedTemplate("tokenizer", own)
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'from file' }}")
    assert resolve_chat_template(tok, str(path)) == ResolvedTemplate("flag", "{{ 'from file' }}")
    assert resolve_chat_template(tok, "{{ 'inline' }}").template == "{{ 'inline' }}"
    bare = _Tok(["<|im_start|>"])
    assert resolve_chat_template(bare, None).source == "bundled:chatml.jinja"
    assert resolve_chat_template(_Tok(["x"]), None) is None
    named = _Tok([], chat_template={"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"})
    assert resolve_chat_template(named, None).template == "{{ 'd' }}"


def test_flag_template_errors_and_escapes():
    with pytest.raises(ConfigError, match="--chat-template"):
        load_flag_template("/no/such/file.jinja")
    assert load_flag_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"


def test_sandbox_and_helpers():
    renderer = ChatRenderer(_Tok([]), None)
    with pytest.raises(APIError) as info:
        renderer.render(CONVERSATION)
    assert info.value.code == "no_chat_template"
    with pytest.raises(APIError):
        renderer.render(CONVERSATION, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(APIError):  # the immutable sandbox forbids mutating arguments
        renderer.render(CONVERSATION, chat_template="{{ messages.append(1) }}")
    text = renderer.render(
        CONVERSATION[:1], chat_template="{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
    )
    assert text == '{"role": "system", "content": "Be kind."}|4'
    loops = renderer.render(
        CONVERSATION,
        chat_template="{% for m in messages %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}",
    )
    assert loops == "system"
    kwargs = renderer.render(
        CONVERSATION, chat_template="{{ flavour }}", chat_template_kwargs={"flavour": "mint"}
    )
    assert kwargs == "mint"
    with pytest.raises(APIError) as info:
        renderer.render(CONVERSATION, chat_template="x", chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"


def test_continue_final_message():
    renderer = ChatRenderer(_Tok([]), ResolvedTemplate("t", load_bundled_template("chatml.jinja")))
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    text = renderer.render(conv, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nOnce upon")
    with pytest.raises(APIError):
        renderer.render(conv, add_generation_prompt=True, continue_final_message=True)


def test_render_and_tokenize_with_a_real_tokenizer(tokenizer):
    tok = tokenizer
    renderer = ChatRenderer(tok, resolve_chat_template(tok, None))
    text, ids = renderer.render_and_tokenize([{"role": "user", "content": "hello world"}])
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
