"""Incremental detokenization with the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compute.tokenizer.tokenizer import Tokenizer
from services.pipeline.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.support.fake_engine import smollm2_tokenizer

SAMPLES = [
    "Hello, world!",
    "  leading spaces and   runs of spaces  ",
    "Crème brûlée, naïve façade, São Paulo, Ærø, Œuvre",
    "日本語のテキストと中文字符和한국어",
    "Emoji: 🎉🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽 keycap 1️⃣",
    "mixed\nlines\n\n\ttabs and 数字 123 ∑∫√ ≠ ≤",
    " 🎉",
    "é",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return smollm2_tokenizer()


def stream_pieces(tok: Tokenizer, ids: list[int], step: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok.hf)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_token_by_token_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream_pieces(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@pytest.mark.parametrize("step", [2, 3, 7])
def test_multi_token_deltas(tokenizer: Tokenizer, step: int) -> None:
    text = " ".join(SAMPLES)
    pieces = stream_pieces(tokenizer, tokenizer.encode(text), step)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_split_character_is_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the emoji should span several byte tokens"
    detok = IncrementalDetokenizer(tokenizer.hf)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"


def test_flush_of_a_truncated_character_matches_full_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 日本")[:-1]  # cut inside the last character's bytes
    detok = IncrementalDetokenizer(tokenizer.hf)
    streamed = "".join(detok.add([i]) for i in ids)
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert "".join(stream_pieces(tokenizer, ids)) == "assistant\nHi there"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_any_text_streams_back_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream_pieces(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    # Some bytes (e.g. 0xF1, lead byte of U+40000..) are missing from the vocabulary, so
    # the encoding itself is lossy there; elsewhere no U+FFFD may appear.
    if tokenizer.decode(ids) == text and REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
