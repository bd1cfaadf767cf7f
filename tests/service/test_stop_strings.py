"""Stop-string matching over streamed chunks: nothing of a stop string ever leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.pipeline.stop_strings import StopStringMatcher, first_stop, truncate_at_stop


def stream(
    chunks: list[str], stops: list[str], include: bool = False
) -> tuple[list[str], str | None]:
    """Emitted pieces (flushed at the end when no stop hit) and the matched stop."""
    matcher = StopStringMatcher(stops, include)
    out: list[str] = []
    for chunk in chunks:
        result = matcher.feed(chunk)
        out.append(result.text)
        if result.matched is not None:
            return out, result.matched
    out.append(matcher.flush())
    return out, None


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


ALPHABET = "ab\n .é🎉"
texts = st.text(alphabet=ALPHABET, max_size=60)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4)


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(0, 60), max_size=20), st.booleans())
def test_streaming_equals_whole_text_truncation(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    pieces, matched = stream(split(text, cuts), stops, include)
    assert "".join(pieces) == truncate_at_stop(text, stops, include)
    hit = first_stop(text, stops)
    assert matched == (hit[1] if hit else None)


@settings(max_examples=200, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(0, 60), max_size=20))
def test_no_emitted_prefix_ever_contains_a_stop_string(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    pieces, _ = stream(split(text, cuts), stops)
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert not any(stop in emitted for stop in stops)


def test_stop_string_spanning_two_chunks_is_held_back() -> None:
    matcher = StopStringMatcher(["\n\n"])
    first = matcher.feed("Hello\n")
    assert first.text == "Hello" and first.matched is None
    second = matcher.feed("\nWorld")
    assert second.text == "" and second.matched == "\n\n"


def test_include_stop_str_in_output() -> None:
    pieces, matched = stream(["The end", " STO", "P and more"], ["STOP"], include=True)
    assert "".join(pieces) == "The end STOP"
    assert matched == "STOP"


def test_text_that_cannot_start_a_stop_string_is_not_held() -> None:
    matcher = StopStringMatcher(["xyz"])
    assert matcher.feed("abc").text == "abc"
    assert matcher.feed("ab x").text == "ab "  # "x" might start "xyz"
    assert matcher.feed("a").text == "xa"


def test_the_stop_string_that_completes_first_wins() -> None:
    # "bcd" starts later than "abcdef" but is complete sooner.
    assert first_stop("xabcdefg", ["abcdef", "bcd"]) == (2, "bcd")
    # Same end: the longer (earlier starting) one.
    assert first_stop("xabc", ["bc", "abc"]) == (1, "abc")


def test_no_stop_strings_passes_everything_through() -> None:
    pieces, matched = stream(["a", "b\n", "c"], [])
    assert pieces == ["a", "b\n", "c", ""] and matched is None


def test_flush_releases_held_tail_when_stream_ends() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the EN").text == "the "
    assert matcher.flush() == "EN"
