"""Cheap size limits on a request, checked before any tokenizing or templating.

A request is measured on its wire form (byte counts of the decoded protobuf, list
lengths), so a check costs microseconds whatever the input holds: a 15 MiB prompt is
refused before a tokenizer thread spends seconds and gigabytes on it. The model's own
limits (context length, KV cache) are checked later, on token ids; stage 1 also stops
early on a prompt that cannot fit (``Tokenizer.min_tokens``). Every limit is a flag
(services/cli/cli_flags.py) and is listed in docs/configuration.md, generated from them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from compute.core.errors import FieldError
from compute.core.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

MIB = 1024 * 1024
DEFAULT_MAX_BATCH_REQUESTS = 64  # most requests in one GenerateBatch call


@dataclass(frozen=True)
class InputLimits:
    max_request_bytes: int = 4 * MIB  # one request message (a batch: the whole batch)
    max_prompt_bytes: int = 1 * MIB  # UTF-8 bytes of `prompt`
    max_chat_messages: int = 256  # messages in `chat`
    max_chat_bytes: int = 1 * MIB  # UTF-8 bytes of all chat roles and contents together
    max_stop_strings: int = MAX_STOP_STRINGS  # stop strings per request
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS  # characters per stop string

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")
        # The engine's own caps (SamplingParams) stay the ceiling.
        if self.max_stop_strings > MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be <= {MAX_STOP_STRINGS}")
        if self.max_stop_string_chars > MAX_STOP_STRING_CHARS:
            raise ValueError(f"max_stop_string_chars must be <= {MAX_STOP_STRING_CHARS}")


def check_request_size(request, limits: InputLimits) -> None:
    """FieldError if the whole message is over ``max_request_bytes``."""
    size = request.ByteSize()
    if size > limits.max_request_bytes:
        raise FieldError("request", f"at most {limits.max_request_bytes} bytes (got {size})")


def check_input(request, limits: InputLimits) -> None:
    """The prompt/chat sizes of a Generate or Tokenize request (a GenerateBatch item)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        _at_most("prompt", _utf8_bytes(request.prompt), limits.max_prompt_bytes, "bytes")
    elif kind == "chat":
        messages = request.chat.messages
        _at_most("chat.messages", len(messages), limits.max_chat_messages, "messages")
        total = sum(_utf8_bytes(m.role) + _utf8_bytes(m.content) for m in messages)
        _at_most("chat.messages", total, limits.max_chat_bytes, "bytes of role and content")
    if hasattr(request, "stopping"):  # TokenizeRequest has none
        stop = request.stopping.stop
        _at_most("stopping.stop", len(stop), limits.max_stop_strings, "strings")
        longest = max((len(s) for s in stop), default=0)
        _at_most("stopping.stop", longest, limits.max_stop_string_chars, "characters per string")


def _utf8_bytes(text: str) -> int:
    # str.encode copies; for ASCII text (the common big case) len is the byte count.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _at_most(field: str, value: int, limit: int, unit: str) -> None:
    if value > limit:
        raise FieldError(field, f"at most {limit} {unit} (got {value})")
