"""The RWKV World tokenizer as llama.cpp stores it: tokens escaped as the converter writes them, greedy
longest match over bytes; equal to the ``rwkv`` package's TRIE_TOKENIZER on mixed text, and
``decode(encode(text)) == text`` for any text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.rwkv_reference import world_vocab
from rsmem.engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from rsmem.loaders.rwkv.tokenizer import RwkvTokenizer, escape_rwkv_token, unescape_rwkv_token

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\tand\r\nCRLF line ends\n\n\nand blank lines   ",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n",
    "我们来谈谈人工智能。机器学习是一个很有意思的领域！",
    "日本語のテキストとカタカナ、ひらがな。",
    "Ünïcödé façade, naïve café; Ελληνικά; русский текст; עברית; العربية",
    "emoji 😀🙃👍🏽 and ZWJ 👩‍👩‍👧 sequences, flags 🇫🇷",
    "control \x00\x01\x1f and DEL \x7f, backslash \\ and quotes ' \" \\x41",
    "User: hi\n\nAssistant: hello there\n\nUser:",
    "a" * 300 + " " + "=" * 70,
]


@pytest.fixture(scope="module")
def vocab() -> list[bytes]:
    return world_vocab()


@pytest.fixture(scope="module")
def tok(vocab) -> RwkvTokenizer:
    texts = [escape_rwkv_token(t) for t in vocab]  # the GGUF form
    return RwkvTokenizer.from_gguf(texts, [3] + [1] * (len(texts) - 1))


@pytest.fixture(scope="module")
def reference():
    from pathlib import Path

    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(str(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"))


def test_escaping_round_trips_every_token(vocab) -> None:
    assert len(vocab) == 65530
    for token in vocab:
        text = escape_rwkv_token(token)
        assert text.isascii()
        assert unescape_rwkv_token(text) == token


def test_unescape_follows_llamacpp() -> None:
    assert unescape_rwkv_token(r"a\tb\nc\rd") == b"a\tb\nc\rd"
    assert unescape_rwkv_token(r"\xe4\xbd\xa0") == "你".encode()
    assert unescape_rwkv_token(r"\\ \' x") == b"\\ ' x"


@pytest.mark.parametrize("text", CORPUS)
def test_matches_the_rwkv_package(tok, reference, text: str) -> None:
    ids = tok.encode(text).ids
    assert ids == reference.encode(text)
    assert tok.decode(ids) == text


def test_whole_corpus_at_once(tok, reference) -> None:
    text = "\n".join(CORPUS) * 3
    assert tok.encode(text).ids == reference.encode(text)


@pytest.mark.fuzz
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trips_any_text(tok, text: str) -> None:
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    ends = [e for _, e in enc.offsets]
    assert ends == sorted(ends) and (not ends or ends[-1] == len(text))


def test_control_token_is_not_matched_in_text(tok) -> None:
    ids = tok.encode("<s>").ids
    assert 0 not in ids and tok.decode(ids) == "<s>"
    assert tok.decode([0, *ids]) == "<s>"  # skipped as special
    assert tok.decode([0], skip_special_tokens=False) == "<s>"


def test_streaming_holds_back_cut_characters(tok) -> None:
    text = "我们 😀 café"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(TextTokenizer(tok))  # type: ignore[arg-type]
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
