"""Incremental detokenizer: streamed pieces add up to the full decode; stop strings; token texts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from aserve.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, decode_token_texts

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text, one token at a time: hello world!",
    "def main():\n    print('hi')\n    return 0\n",
    "Numbers 12345 and symbols #$%&*() with   spaces.",
    "Héllo wörld, café crème, naïve façade.",
    "Emoji 🤗🚀 and CJK 世界 你好 mixed in.",
]
TEXTS = ["Hello there!", " leading space", "🤗 emoji first", "Mixed 世界 and émoji 🚀🚀 end",
         "new\nlines\n\nand  double  spaces", "a", "世", "🤗", "ok <s> not special </s>"]


# -- tokenizers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def byte_level():
    """A GPT-2-style byte-level BPE trained in memory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _byte_fallback_tokenizer(strip_leading_space: bool) -> PreTrainedTokenizerFast:
    """SentencePiece-like: '▁' for spaces, <0xXX> tokens for characters outside the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?:;'()#$%&*\n-é":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("l", "l"), ("e", "ll"), ("▁", "w")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_fallback():
    return _byte_fallback_tokenizer(strip_leading_space=False)


@pytest.fixture(scope="module")
def llama_like():
    return _byte_fallback_tokenizer(strip_leading_space=True)


# -- helpers ----------------------------------------------------------------------------------------
def stream(tokenizer, prompt_ids, output_ids, chunks=None, skip=True, spaces=True):
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), skip, spaces)
    pieces, i = [], 0
    for size in chunks or [1] * len(output_ids):
        pieces.append(detok.update(list(output_ids[i:i + size])))
        i += size
    assert i >= len(output_ids)
    pieces.append(detok.flush())
    assert detok.output_text == "".join(pieces)
    assert detok.token_ids == list(output_ids)
    return pieces


def chunking(draw_sizes, n):
    sizes, total = [], 0
    for s in draw_sizes:
        if total >= n:
            break
        sizes.append(min(s, n - total))
        total += sizes[-1]
    if total < n:
        sizes.append(n - total)
    return sizes


# -- the contract on real and hand-built tokenizers -------------------------------------------------
@pytest.mark.parametrize("tok_name", ["smollm2", "byte_level", "byte_fallback"])
@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_full_decode(request, tok_name, skip):
    tok = request.getfixturevalue(tok_name)
    prompts = [[], tok.encode("A prompt that ends here:", add_special_tokens=False),
               tok.encode("<s>", add_special_tokens=False)]
    for prompt in prompts:
        for text in TEXTS:
            out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            pieces = stream(tok, prompt, out, skip=skip)
            assert "".join(pieces) == tok.decode(out, skip_special_tokens=skip), (prompt, text)


def test_multibyte_characters_wait_for_their_last_byte(smollm2, byte_fallback):
    for tok in (smollm2, byte_fallback):
        out = tok.encode(" 🤗世", add_special_tokens=False)
        pieces = stream(tok, tok.encode("Hi", add_special_tokens=False), out)
        assert "".join(pieces) == tok.decode(out)
        assert all("\ufffd" not in p for p in pieces)
        assert "" in pieces  # at least one step held an incomplete character back
    ids = byte_fallback.encode("世", add_special_tokens=False)
    assert [byte_fallback.convert_ids_to_tokens(i) for i in ids][-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]


def test_leading_space_after_the_prompt_is_kept(smollm2, llama_like):
    out = smollm2.encode(" Paris", add_special_tokens=False)
    assert "".join(stream(smollm2, smollm2.encode("The capital is"), out)) == " Paris"
    # A SentencePiece decoder drops the first token's space when decoding alone, not after a prompt.
    prompt = llama_like.encode("the", add_special_tokens=False)
    out = llama_like.encode("the", add_special_tokens=False)
    assert llama_like.decode(out) == "the"
    assert "".join(stream(llama_like, prompt, out)) == " the"
    assert "".join(stream(llama_like, [], out)) == "the"


def test_incomplete_character_at_the_end_is_released_by_flush(smollm2):
    ids = smollm2.encode("🤗", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, [])
    assert detok.update(ids[:-1]) == ""
    assert detok.flush() == smollm2.decode(ids[:-1])
    assert detok.output_text.endswith("\ufffd")


def test_multi_token_updates(byte_level):
    out = byte_level.encode("Streaming text, one token at a time: 世界!", add_special_tokens=False)
    pieces = stream(byte_level, [], out, chunks=[3, 1, 5, len(out)])
    assert "".join(pieces) == byte_level.decode(out)
    assert IncrementalDetokenizer(byte_level, []).update([]) == ""


class PythonOnly:
    """A tokenizer without a Rust backend (like a slow tokenizer): only `decode`."""

    def __init__(self, tok):
        self.tok = tok
        self.calls = []

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        self.calls.append(spaces_between_special_tokens)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback"])
def test_python_path_matches_decode(request, tok_name):
    tok = request.getfixturevalue(tok_name)
    slow = PythonOnly(tok)
    assert IncrementalDetokenizer(slow, [])._stream is None
    for text in TEXTS:
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        for skip in (True, False):
            pieces = stream(slow, tok.encode("Hi", add_special_tokens=False), out, skip=skip)
            assert "".join(pieces) == tok.decode(out, skip_special_tokens=skip)


def test_rust_stream_refusal_falls_back_to_python(byte_fallback):
    """A valid character followed by a stray byte token: the byte-fallback decoder rewrites the whole
    byte run, which the Rust stream refuses; streaming goes on in Python without raising."""
    ids = byte_fallback.encode("世", add_special_tokens=False)[-3:] + [byte_fallback.convert_tokens_to_ids("<0x80>")]
    detok = IncrementalDetokenizer(byte_fallback, [])
    assert detok.update(ids[:3]) == "世"
    detok.update(ids[3:])
    detok.update([byte_fallback.convert_tokens_to_ids("a")])
    assert detok._stream is None
    assert detok.output_text.startswith("世") and detok.output_text.endswith("a")


def test_spaces_between_special_tokens_is_passed_to_decode(byte_level):
    calls = []

    class SlowTokenizer:  # no Rust backend: the Python path with tokenizer.decode
        def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
            calls.append(spaces_between_special_tokens)
            sep = " " if spaces_between_special_tokens else ""
            return sep.join(byte_level.decode([i], skip_special_tokens=skip_special_tokens) for i in ids)

    out = byte_level.encode("ab cd", add_special_tokens=False) + [byte_level.eos_token_id]
    pieces = stream(SlowTokenizer(), [], out, skip=False, spaces=False)
    assert "".join(pieces) == SlowTokenizer().decode(out, spaces_between_special_tokens=False)
    assert calls and not any(calls)


# -- properties -------------------------------------------------------------------------------------
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_property_random_ids_byte_level(byte_level, data, skip):
    vocab = len(byte_level)
    out = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    sizes = chunking(data.draw(st.lists(st.integers(1, 4), max_size=30)), len(out))
    assert "".join(stream(byte_level, prompt, out, sizes, skip=skip)) == byte_level.decode(out, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_property_random_ids_smollm2(smollm2, data, skip):
    vocab = len(smollm2)
    out = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    sizes = chunking(data.draw(st.lists(st.integers(1, 3), max_size=30)), len(out))
    assert "".join(stream(smollm2, prompt, out, sizes, skip=skip)) == smollm2.decode(out, skip_special_tokens=skip)


@PROPERTY
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=25),
       prompt=st.sampled_from(["", "Q:", "say 世"]), skip=st.booleans())
def test_property_random_text_byte_fallback(byte_fallback, text, prompt, skip):
    out = byte_fallback.encode(text, add_special_tokens=False)
    if skip is False:
        out = out + [byte_fallback.eos_token_id]
    prompt_ids = byte_fallback.encode(prompt, add_special_tokens=False) if prompt else []
    assert "".join(stream(byte_fallback, prompt_ids, out, skip=skip)) == byte_fallback.decode(out, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data())
def test_property_random_ids_byte_fallback_never_raise(byte_fallback, data):
    """Arbitrary byte-token soup: pieces still add up whenever the decode of every prefix is a prefix
    of the full decode (a run of byte tokens that turns invalid later rewrites earlier text)."""
    vocab = len(byte_fallback)
    out = data.draw(st.lists(st.integers(0, vocab - 1), max_size=25))
    skip = data.draw(st.booleans())
    text = "".join(stream(byte_fallback, [], out, skip=skip))
    full = byte_fallback.decode(out, skip_special_tokens=skip)
    prefixes = [byte_fallback.decode(out[:i], skip_special_tokens=skip) for i in range(len(out) + 1)]
    if all(full.startswith(p.rstrip("\ufffd")) for p in prefixes):
        assert text == full


# -- stop strings -----------------------------------------------------------------------------------
def test_stop_string_within_new_text():
    assert check_stop_strings("Hello world", 5, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("Hello world", 5, ["wor"], True) == ("wor", 9)
    assert check_stop_strings("Hello world", 5, ["xyz"], False) is None
    assert check_stop_strings("Hello world", 0, ["wor"], False) is None
    assert check_stop_strings("Hello world", 3, [], False) is None


def test_stop_string_spanning_earlier_text():
    # "lo w" starts in old text and ends in the 2 new characters.
    assert check_stop_strings("Hello wo", 2, ["lo w"], False) == ("lo w", 3)
    # A match that ended before the new characters was already seen.
    assert check_stop_strings("Hello world", 2, ["Hello"], False) is None


def test_earliest_stop_string_wins():
    assert check_stop_strings("abcdef", 6, ["ef", "bc"], False) == ("bc", 1)
    assert check_stop_strings("abcdef", 6, ["ef", "bc"], True) == ("bc", 3)


def test_stop_string_across_token_boundaries(smollm2):
    out = smollm2.encode("The answer is: forty-two. END of message", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, [])
    hit = None
    for tok in out:
        new = detok.update([tok])
        hit = check_stop_strings(detok.output_text, len(new), ["two. EN"], False)
        if hit:
            break
    assert hit is not None and hit[0] == "two. EN"
    assert detok.output_text[:hit[1]] == "The answer is: forty-"


@given(st.text("ab", max_size=20), st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=3),
       st.booleans())
def test_property_stop_strings_match_a_full_scan(text, stop, include):
    """Fed one character at a time, the first hit is the stop string that completes first (the longest
    one if several complete on the same character), cut where it starts (or ends, with include)."""
    found = None
    for n in range(1, len(text) + 1):
        found = check_stop_strings(text[:n], 1, stop, include)
        if found:
            break
    occurrences = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not occurrences:
        assert found is None
        return
    end, start, s = min(occurrences)
    assert found == (s, end if include else start)


# -- token texts ------------------------------------------------------------------------------------
def test_decode_token_texts(smollm2, byte_fallback, llama_like):
    ids = smollm2.encode("Hello world 🤗", add_special_tokens=False)
    texts = decode_token_texts(smollm2, ids + [smollm2.eos_token_id, 10**9])
    assert texts[:2] == ["Hello", " world"]
    assert all("\ufffd" not in t for t in texts)
    assert texts[-2] == smollm2.eos_token and texts[-1] == ""
    bf = byte_fallback.encode("a 世", add_special_tokens=False)
    bf_texts = decode_token_texts(byte_fallback, bf)
    assert bf_texts[0] == " a" and bf_texts[-3:] == ["", "", ""]
    assert decode_token_texts(llama_like, llama_like.encode("the", add_special_tokens=False)) == [" the"]
    assert decode_token_texts(smollm2, []) == []
