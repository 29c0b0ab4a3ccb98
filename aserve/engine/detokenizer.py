"""Incremental detokenizing for streaming, stop-string search and per-token texts for logprobs.

The streamed pieces of a request add up to the text of its output tokens, decoded with a few prompt
tokens as left context so that a decoder that treats the first token specially (SentencePiece's
leading space) keeps the space the output really starts with. Incomplete UTF-8 (a character split over
byte tokens) is held back until a later token completes it; `flush()` releases what is still held when
the request ends.

Fast tokenizers stream through the Rust `tokenizers.decoders.DecodeStream` on their backend, which
decodes like `tokenizer.decode` (a fast tokenizer's decode ignores `spaces_between_special_tokens`; like
vLLM we never apply `clean_up_tokenization_spaces`, which can rewrite text already streamed). A tokenizer
without a Rust backend (a slow one, where `spaces_between_special_tokens` matters), or a stream the Rust
side refuses (a decoder that rewrote earlier text), goes through the same prefix/read-offset algorithm
in Python around `decode`. No torch here.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from aserve.engine.tokenizer_kinds import is_mistral_tokenizer

# Prompt tokens decoded as left context of the output (enough for any decoder's look-behind).
_NUM_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"  # what decoding yields for incomplete / invalid UTF-8


def _rust_backend(tokenizer: Any) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class IncrementalDetokenizer:
    """Turns a request's output tokens into text, one step at a time.

    `update(ids)` returns only the new text; `output_text` holds everything so far and `token_ids` the
    output tokens. The concatenation of all pieces plus `flush()` equals the output decoded in the
    context of the prompt's last tokens; for decoders without position-dependent rules (byte-level BPE,
    byte-fallback BPE) that is exactly `tokenizer.decode(token_ids, skip_special_tokens=...)`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self._backend = _rust_backend(tokenizer)
        self._mistral = is_mistral_tokenizer(tokenizer)

        # Left context: the prompt's last tokens, unless they end inside a character or decode to nothing.
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if not context_text or context_text.endswith(_REPLACEMENT):
            context, context_text = [], ""
        self._all_ids = context  # context + outputs
        # Everything before `_read_offset` has been emitted; `_prefix_text` decodes [_prefix_offset, _read_offset).
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens) \
            if self._backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if self._mistral:  # mistral_common's decode has no spaces_between_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Appends tokens; returns the new text ("" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        self._all_ids.extend(new_token_ids)
        piece = None
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, new_token_ids[0] if len(new_token_ids) == 1
                                          else list(new_token_ids))
            except Exception:  # noqa: BLE001 - the Rust stream raises a bare Exception on an invalid prefix
                # The decoder rewrote text before the stream's prefix: go on in Python.
                self._stream = None
                self._prefix_text = self._decode(self._all_ids[self._prefix_offset:self._read_offset])
        if self._stream is None:
            piece = self._step_python()
        if not piece:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._all_ids)
        if self._stream is None:
            self._prefix_text = self._decode(self._all_ids[self._prefix_offset:])
        self.output_text += piece
        return piece

    def _step_python(self) -> str | None:
        text = self._decode(self._all_ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return None
        # If the decoder rewrote text already sent (it should not), what was sent stays sent.
        return text[len(self._prefix_text):]

    def flush(self) -> str:
        """Releases text held back for an incomplete character; call once the request has finished."""
        if self._read_offset >= len(self._all_ids):
            return ""
        prefix = self._decode(self._all_ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._all_ids[self._prefix_offset:])
        piece = text[len(prefix):]
        self._stream = None  # its state still holds the flushed tokens: later tokens go through Python
        self._prefix_offset, self._read_offset = self._read_offset, len(self._all_ids)
        self._prefix_text = self._decode(self._all_ids[self._prefix_offset:])
        self.output_text += piece
        return piece


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `new_char_count` characters of `output_text`.

    Returns `(stop_string, length to truncate output_text to)`: the text is cut before the stop
    string, or right after it with `include_stop_str_in_output`. None when nothing matched.
    """
    if not stop or new_char_count <= 0:
        return None
    best: tuple[str, int] | None = None
    n = len(output_text)
    for s in stop:
        # Only a match that ends in the new characters is new; it may start before them.
        idx = output_text.find(s, max(0, n - new_char_count - len(s) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    if best is None:
        return None
    s, idx = best
    return s, idx + len(s) if include_stop_str_in_output else idx


def decode_token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's own text (for logprobs' `decoded_token`), decoded in one batch; never raises.

    A token holding only part of a character (byte-level or byte-fallback pieces) yields the text it
    does hold, without replacement characters; an unknown id yields ""."""
    if not token_ids:
        return []
    backend = _rust_backend(tokenizer)
    if backend is not None:
        try:
            texts = backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - never raise for a logprob's text
            texts = [_decode_one(backend, t) for t in token_ids]
    else:
        texts = [_decode_one(tokenizer, t) for t in token_ids]
    out = []
    for t, text in zip(token_ids, texts):
        piece = _raw_piece(tokenizer, backend, t)
        if _REPLACEMENT in text and _REPLACEMENT not in piece and "ï¿½" not in piece:
            text = text.replace(_REPLACEMENT, "")
        if piece.startswith("▁") and not text.startswith(" "):
            text = " " + text  # SentencePiece decoders drop a lone token's leading space
        out.append(text)
    return out


def _decode_one(tokenizer: Any, token_id: int) -> str:
    try:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - never raise for a logprob's text
        return ""
    return text if isinstance(text, str) else ""


def _raw_piece(tokenizer: Any, backend: Tokenizer | None, token_id: int) -> str:
    try:
        piece = backend.id_to_token(token_id) if backend is not None \
            else tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # noqa: BLE001 - never raise for a logprob's text
        return ""
    return piece if isinstance(piece, str) else ""
