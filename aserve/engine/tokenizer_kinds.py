"""What kind of tokenizer the engine holds, asked without importing transformers."""

from __future__ import annotations

from typing import Any

MISTRAL_TOKENIZER_CLASS = "MistralCommonBackend"  # transformers' wrapper of mistral_common's tokenizer


def is_mistral_tokenizer(tokenizer: Any) -> bool:
    """Whether `tokenizer` is transformers' MistralCommonBackend (`--tokenizer-mode mistral`): its
    `decode` takes no `spaces_between_special_tokens`, and chats are encoded by mistral_common."""
    return type(tokenizer).__name__ == MISTRAL_TOKENIZER_CLASS
