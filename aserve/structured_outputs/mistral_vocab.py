"""xgrammar's view of a mistral_common tokenizer (`--tokenizer-mode mistral`), which has no Hugging
Face `tokenizers` backend for `TokenizerInfo.from_huggingface` to read.

SentencePiece tokenizers (tokenizer.model.v*) give their pieces with byte fallback (`<0x0A>`) and a
leading-space marker; Tekken tokenizers (tekken.json) give each token's raw bytes. Control tokens
([INST], <s>, ...) get an empty entry, so no grammar ever allows them; the request's stop ids end a
completed grammar as with any tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xgrammar as xgr


def mistral_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None) -> xgr.TokenizerInfo:
    """`tokenizer`: transformers' MistralCommonBackend. `vocab_size`: the logits width."""
    inner = tokenizer.tokenizer.instruct_tokenizer.tokenizer
    n = inner.n_words
    special = {int(i) for i in inner.special_ids} if hasattr(inner, "special_ids") else set()
    stops = list(stop_token_ids) if stop_token_ids else [inner.eos_id]
    if hasattr(inner, "id_to_byte_piece"):  # Tekken: byte-level tokens
        vocab = [b"" if i in special else inner.id_to_byte_piece(i) for i in range(n)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = ["" if i in special else inner.id_to_piece(i) for i in range(n)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=True)
