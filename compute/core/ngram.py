"""N-gram (prompt-lookup) drafts for speculative decoding. Pure Python, no torch.

The draft for a sequence is what followed the latest earlier occurrence of its last n
tokens, for the largest n in [ngram_min, ngram_max] that occurs earlier (in prompt +
output): a sequence that copies or lightly edits its input is then guessed a few tokens
ahead, and one step verifies the guess (compute/core/scheduler.py, compute/sampling/sampler.py).

How far to guess depends on how much agreed: a match of n tokens proposes at most 2n - 1
(1 after a single matching token, 3 after two, 5 after three). A one-token match is a weak
guess, right about where an edit ends and the copying resumes and wrong in most free text,
so it risks only one draft token, which barely widens the step; a longer match is likelier
to continue and earns the whole draft. Measured on the default model
(bench/speculative.py): with drafts from one-token matches on, this rule copies faster than
any fixed length and keeps free-form text at the plain speed.

``NgramIndex`` is what the engine runs: per sequence, the latest end position of every
n-gram it holds, extended as tokens are appended, so a draft costs O(ngram_max) dictionary
lookups per step whatever the context (a scan of the context per sequence per step was
O(context)). ``propose_ngram``, the scan, is its reference: they give the same drafts.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Tokens(Protocol):
    """A growing token sequence (compute/core/sequence.py ``Sequence``)."""

    @property
    def num_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, stop: int) -> list[int]: ...


class NgramIndex:
    """The latest end position of each n-gram (ngram_min <= n <= ngram_max) of one
    sequence, for n-grams ending before its last token, kept up to date lazily: each
    position is indexed once, when a draft is next asked for."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions below this are in the index
        self._tail: deque[int] = deque(maxlen=ngram_max)  # the tokens up to _indexed
        self.tokens_read = 0  # cumulative, for the tests' cost count

    def propose(self, tokens: Tokens, num_tokens: int) -> list[int]:
        """``propose_ngram(all tokens, num_tokens, ngram_min, ngram_max)``, from the index."""
        n = tokens.num_tokens
        if num_tokens <= 0 or n <= self.ngram_min:
            return []
        if n - 1 < self._indexed:  # the sequence got shorter: start over
            self.__init__(self.ngram_min, self.ngram_max)
        self._extend(tokens, n - 1)
        longest = min(self.ngram_max, n - 1)
        suffix = tokens.token_ids_slice(n - longest, n)
        self.tokens_read += longest
        for length in range(longest, self.ngram_min - 1, -1):
            end = self._latest.get(tuple(suffix[longest - length :]))
            if end is not None:
                size = min(num_tokens, max_draft(length))
                draft = tokens.token_ids_slice(end + 1, min(end + 1 + size, n))
                self.tokens_read += len(draft)
                return draft
        return []

    def _extend(self, tokens: Tokens, stop: int) -> None:
        """Index the n-grams ending at positions [_indexed, stop)."""
        if stop <= self._indexed:
            return
        new = tokens.token_ids_slice(self._indexed, stop)
        self.tokens_read += len(new)
        tail, latest = self._tail, self._latest
        for end, token in enumerate(new, self._indexed):
            tail.append(token)
            window = tuple(tail)
            for length in range(self.ngram_min, len(window) + 1):
                latest[window[len(window) - length :]] = end
        self._indexed = stop


def propose_ngram(tokens: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens to follow ``tokens``, or [] when no suffix of at
    least ``ngram_min`` tokens occurs earlier. The longest match (up to ``ngram_max``)
    wins; among equally long ones, the latest. A match of n tokens drafts at most
    ``max_draft(n)`` of them."""
    n = len(tokens)
    if num_tokens <= 0 or n <= ngram_min:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    # Candidate matches end at j (tokens[j] == last, j < n - 1), latest first.
    j = n - 1
    while True:
        try:
            j = _rindex(tokens, last, j)
        except ValueError:
            break
        length = 1
        while length < ngram_max and length <= j and tokens[j - length] == tokens[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, j
            if length == ngram_max:
                break
    if best_len < ngram_min:
        return []
    size = min(num_tokens, max_draft(best_len))
    return tokens[best_end + 1 : best_end + 1 + size]


def max_draft(match_len: int) -> int:
    """The most draft tokens a match of ``match_len`` tokens proposes: 2n - 1."""
    return 2 * match_len - 1


def _rindex(tokens: list[int], value: int, stop: int) -> int:
    """The largest index i < ``stop`` with tokens[i] == value (ValueError if none)."""
    for i in range(stop - 1, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
