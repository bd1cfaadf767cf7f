"""Stage 3: incremental detokenization of one request's output tokens.

Byte-level BPE splits multi-byte characters (CJK, emoji, accents) across tokens, and
per-token decoding loses the spaces that SentencePiece-style decoders strip from a
leading token. So, like vLLM and SGLang, we keep two offsets into the token list:
``prefix`` (start of a short window of already-emitted tokens that gives the decoder
context) and ``read`` (end of what has been emitted). New text is
``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``; while it ends in U+FFFD
(an incomplete UTF-8 sequence) it is held back until the next token completes it.

``tokenizers.decoders.DecodeStream`` does the same for byte-level BPE, but it gives no
way to flush a held-back tail when the request finishes, which we need so that the
chunks always concatenate to ``decode(all ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of whole-character text deltas."""

    def __init__(self, hf: HFTokenizer, skip_special_tokens: bool = True) -> None:
        self._hf = hf
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens; "" while a character is still incomplete."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        # A valid character split across tokens decodes to U+FFFD until its last byte
        # arrives; emitting it then would put a U+FFFD in the stream for good.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (the request ended mid-character: U+FFFD stays)."""
        if self._read == len(self._ids):
            return ""
        prefix_text, new_text = self._decode_window()
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix :]
        prefix_text = self._decode(window[: self._read - self._prefix])
        return prefix_text, self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._hf.decode(ids, skip_special_tokens=self._skip_special)


class NullDetokenizer:
    """For engines without a tokenizer (dummy weights): token ids only, no text."""

    def add(self, token_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""
