"""Calibration sources of `aserve quantize`: seed 004's token-id file, JSON Lines of texts / chats, the
built-in set; errors name the argument and the line."""

from __future__ import annotations

import json

import pytest

from aserve.quantize import calibration
from aserve.quantize.calibration import CalibrationError
from aserve.quantize.default_texts import CHAT_QUESTIONS, PASSAGES


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.server.real_tiny_server import build_tiny_chat_model

    folder = tmp_path_factory.mktemp("tok")
    build_tiny_chat_model(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_token_id_file_lines_spaces_commas_comments(tmp_path):
    path = tmp_path / "ids.txt"
    path.write_text("# calibration\n1 2 3\n\n4,5, 6\n  7  \n")
    assert calibration.read_token_id_file(str(path), 10) == [[1, 2, 3], [4, 5, 6], [7]]


@pytest.mark.parametrize("text, needle", [
    ("1 2 3\n4 99 5\n", "line 2 has token id 99 outside the model's vocabulary (0..49)"),
    ("1 2 -1\n", "line 1 has token id -1"),
    ("1 2 x\n", "line 1 is not a list of integer token ids"),
    ("\n# only a comment\n", "holds no token ids"),
])
def test_token_id_file_errors_name_flag_and_line(tmp_path, text, needle):
    path = tmp_path / "ids.txt"
    path.write_text(text)
    with pytest.raises(CalibrationError, match="--calib-token-ids") as info:
        calibration.read_token_id_file(str(path), 50)
    assert needle in str(info.value)


def test_token_id_file_missing(tmp_path):
    with pytest.raises(CalibrationError, match="--calib-token-ids: cannot read"):
        calibration.read_token_id_file(str(tmp_path / "nope.txt"), 50)


def test_jsonl_text_prompt_and_messages(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "Hello, how are you today?"}]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join([json.dumps({"text": "The quick brown fox"}), "",
                               json.dumps({"prompt": "Paris is the capital"}), json.dumps({"messages": chat})]))
    got = calibration.read_jsonl(str(path), tokenizer)
    assert got[0] == tokenizer("The quick brown fox")["input_ids"]
    assert got[1] == tokenizer("Paris is the capital")["input_ids"]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert got[2] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in got[2]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "line 2 is not valid JSON"),
    ('{"title": "x"}', "line 2 has none of `text`, `prompt`"),
    ("[1, 2]", "line 2 is not a JSON object"),
    ('{"messages": [{"role": "user"}]}', "line 2: each message needs a string `role` and `content`"),
])
def test_jsonl_errors_name_flag_and_line(tmp_path, tokenizer, line, needle):
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(CalibrationError, match="--calib-dataset") as info:
        calibration.read_jsonl(str(path), tokenizer)
    assert needle in str(info.value)


def test_default_set_renders_questions_with_the_chat_template(tokenizer):
    got = calibration.default_sequences(tokenizer)
    assert len(got) == len(CHAT_QUESTIONS) + len(PASSAGES)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(start in seq for seq in got[: len(CHAT_QUESTIONS)])
    assert all(start not in seq for seq in got[len(CHAT_QUESTIONS):])
    assert len(set(map(tuple, got))) == len(got)


def test_select_cuts_and_counts():
    assert calibration.select([[1, 2, 3], [], [4, 5], [6]], num_samples=2, max_seq_length=2) == [[1, 2], [4, 5]]
