"""Chats under `--tokenizer-mode mistral`: mistral_common encodes the conversation (its own request
format: [INST] blocks, [AVAILABLE_TOOLS], tool calls and results) straight to token ids, as vLLM does
for Mistral tokenizers; no jinja template is involved, so a `chat_template` is refused (400) rather
than ignored. `chat_template_kwargs` may carry only `reasoning_effort` (mistral_common's own option)."""

from __future__ import annotations

from typing import Any

from aserve.engine.tokenizer_kinds import is_mistral_tokenizer
from aserve.server.errors import bad_request

__all__ = ["is_mistral_tokenizer", "render_mistral"]


def render_mistral(tokenizer: Any, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, chat_template: str | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """(prompt text, prompt token ids) for `conversation`; APIError(400) naming the field on input
    mistral_common refuses. The text is the ids decoded (for echo and logs)."""
    if chat_template is not None:
        raise bad_request("--tokenizer-mode mistral encodes chats with mistral_common; a chat_template "
                          "cannot be used", param="chat_template")
    kwargs = dict(chat_template_kwargs or {})
    unknown = kwargs.keys() - {"reasoning_effort"}
    if unknown:
        raise bad_request(f"--tokenizer-mode mistral takes only reasoning_effort here, not {sorted(unknown)}",
                          param="chat_template_kwargs")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          param="continue_final_message")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=True, return_dict=False,
                                            continue_final_message=continue_final_message, **kwargs)
    except Exception as exc:  # noqa: BLE001 - mistral_common's validation errors are the request's fault
        raise bad_request(f"mistral_common cannot encode these messages: {type(exc).__name__}: {exc}",
                          param="messages", code="chat_template_error") from None
    ids = [int(i) for i in ids]
    return tokenizer.decode(ids), ids
