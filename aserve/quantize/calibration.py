"""Calibration token sequences for `aserve quantize`, read and checked before any model work.

Three sources (one per run):
  --calib-token-ids FILE   seed 004's format: one sequence of token ids per line, separated by spaces or
                           commas (blank lines and lines starting with `#` are skipped); every id must be
                           within the model's vocabulary.
  --calib-dataset FILE     JSON Lines, one object per line with `text` (a string, tokenized as is),
                           `prompt` (the same), or `messages` (an OpenAI-style chat, rendered with the
                           model's chat template).
  neither                  the built-in set (`default_texts.py`).
Each sequence is cut to `max_seq_length` tokens; the first `num_samples` non-empty ones are used.
`CalibrationError` (a ValueError) names the argument and the line at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aserve.quantize.default_texts import CHAT_QUESTIONS, PASSAGES


class CalibrationError(ValueError):
    """Calibration input that cannot be used; the message names the argument."""


def _read_lines(path: str, flag: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError as exc:
        raise CalibrationError(f"{flag}: cannot read {path!r} ({exc.strerror or exc})") from None


def read_token_id_file(path: str, vocab_size: int) -> list[list[int]]:
    """The sequences of a token-id file (see the module docstring)."""
    flag = "--calib-token-ids"
    lines = _read_lines(path, flag)
    sequences = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            ids = [int(tok) for tok in line.replace(",", " ").split()]
        except ValueError:
            raise CalibrationError(f"{flag}: {path} line {number} is not a list of integer token ids") from None
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise CalibrationError(f"{flag}: {path} line {number} has token id {bad[0]} outside the model's "
                                   f"vocabulary (0..{vocab_size - 1})")
        sequences.append(ids)
    if not sequences:
        raise CalibrationError(f"{flag}: {path} holds no token ids")
    return sequences


def _render(record: Any, tokenizer, where: str) -> list[int]:
    if not isinstance(record, dict):
        raise CalibrationError(f"{where} is not a JSON object")
    if isinstance(record.get("text"), str) or isinstance(record.get("prompt"), str):
        text = record["text"] if isinstance(record.get("text"), str) else record["prompt"]
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        if not getattr(tokenizer, "chat_template", None):
            raise CalibrationError(f"{where} has `messages` but the model's tokenizer has no chat template")
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                   for m in messages):
            raise CalibrationError(f"{where}: each message needs a string `role` and `content`")
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    raise CalibrationError(f"{where} has none of `text`, `prompt` (strings) or `messages` (a chat)")


def read_jsonl(path: str, tokenizer) -> list[list[int]]:
    """The sequences of a JSON Lines calibration file (see the module docstring)."""
    flag = "--calib-dataset"
    lines = _read_lines(path, flag)
    sequences = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{flag}: {path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{where} is not valid JSON ({exc.msg})") from None
        sequences.append(_render(record, tokenizer, where))
    if not sequences:
        raise CalibrationError(f"{flag}: {path} holds no records")
    return sequences


def default_sequences(tokenizer) -> list[list[int]]:
    """The built-in set: each chat question through the chat template (plain text without one), then
    the passages as plain text."""
    out = []
    for question in CHAT_QUESTIONS:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            out.append(list(tokenizer(question, add_special_tokens=True)["input_ids"]))
    out.extend(list(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in PASSAGES)
    return out


def select(sequences: list[list[int]], num_samples: int, max_seq_length: int) -> list[list[int]]:
    """The first `num_samples` non-empty sequences, each cut to `max_seq_length` tokens."""
    return [s[:max_seq_length] for s in sequences if s][:num_samples]
