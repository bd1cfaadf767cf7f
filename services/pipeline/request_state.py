"""Stage 3's per-request state: one request's stream, detokenizer and stop matcher.

``RequestStream`` is the asyncio end a request's events are delivered to. It coalesces:
when a client reads slower than the server generates, the chunks it has not taken yet
are merged into one pending chunk (text, token ids and logprobs concatenated, in order),
so a stream never holds more than one pending chunk plus its final event, however slow
the reader; generation is not paused. The merged chunk is bounded by the request's
max_tokens.
``RequestState`` turns each step's ``RequestOutput`` into the ``Outcome`` (events, done, abort)
that the output stage delivers.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from compute.core.messages import AddRequest, FinishReason, RequestOutput
from compute.tokenizer.tokenizer import Tokenizer
from services.domain import Chunk, Complete, EngineFault, RequestError, Timing, Usage
from services.pipeline.detokenizer import IncrementalDetokenizer, NullDetokenizer
from services.pipeline.stop_strings import StopResult, StopStringMatcher

Event = Chunk | Complete | RequestError


class RequestStream:
    """The asyncio end of one request: stage 3 puts events (on ``loop``), the request's
    generator awaits them. Pending chunks are coalesced (see the module docstring)."""

    MAX_PENDING = 2  # one (coalesced) chunk + the final Complete or error

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: deque[Event] = deque()
        self._ready = asyncio.Event()

    def put(self, event: Event) -> None:
        """Called on ``loop``'s thread only."""
        last = self._pending[-1] if self._pending else None
        if isinstance(event, Chunk) and isinstance(last, Chunk):
            self._pending[-1] = merge_chunks(last, event)  # the reader was slow
        else:
            self._pending.append(event)
        self._ready.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def get(self) -> Event:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()


def merge_chunks(first: Chunk, second: Chunk) -> Chunk:
    """One chunk carrying ``first`` then ``second``."""
    return Chunk(
        text=first.text + second.text,
        token_ids=first.token_ids + second.token_ids,
        logprobs=first.logprobs + second.logprobs,
        tokens=first.tokens + second.tokens,
        top_tokens=first.top_tokens + second.top_tokens,
    )


@dataclass
class Outcome:
    events: list[Event]
    done: bool = False  # the stream ended; forget the request
    abort_engine: bool = False  # a stop string ended it while the engine still runs it


class RequestState:
    """Stage 3's view of one request: detokenizer, stop matcher, counts, timestamps."""

    def __init__(self, req: AddRequest, stream: RequestStream, tokenizer: Tokenizer | None) -> None:
        self.request_id = req.request_id
        self.stream = stream
        self.params = req.params
        self.arrival = req.arrival_time
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self._tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer.hf) if tokenizer else NullDetokenizer()
        self.stop = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)
        # Registered right after stage 1, before stage 2 sees it: the end of tokenizing.
        self.tokenized = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    def on_output(self, d: RequestOutput, step_start: float, now: float) -> Outcome:
        if self.first_scheduled is None:
            self.first_scheduled = d.first_scheduled_time or step_start
        text = self.detok.add(self._text_ids(d))
        if d.finished:
            text += self.detok.flush()
        result = self._match_stops(text, d)
        emit = result.text
        if result.matched is None and d.finished:
            emit += self.stop.flush()
        out = Outcome([self._chunk(emit, d)] if d.new_token_ids or emit else [])
        if result.matched is not None:
            out.events.append(self._complete(FinishReason.STOP, result.matched, d, now))
            out.done, out.abort_engine = True, not d.finished
        elif d.finished:
            out.events.append(self._finish(d, now))
            out.done = True
        return out

    def _match_stops(self, text: str, d: RequestOutput) -> StopResult:
        """Stop strings are matched from the request's min_tokens-th output token on (as
        vLLM): the text before passes through unheld, and is not searched later."""
        if d.num_output_tokens < self.params.min_tokens:
            return StopResult(text)
        return self.stop.feed(text)

    def _text_ids(self, d: RequestOutput) -> tuple[int, ...]:
        # Like vLLM: the EOS/stop token that ended generation is not part of the text
        # unless the caller asked for stop strings/tokens in the output.
        ids = d.new_token_ids
        stopped_by_token = d.stop_token_id is not None and ids and ids[-1] == d.stop_token_id
        if stopped_by_token and not self.params.include_stop_str_in_output:
            return ids[:-1]
        return ids

    def _chunk(self, text: str, d: RequestOutput) -> Chunk:
        logprobs = tuple(lp for lp in d.new_logprobs if lp is not None)
        tokens = tuple(self._token_str(lp.token_id) for lp in logprobs)
        top_tokens = tuple(tuple(self._token_str(t) for t, _ in lp.top) for lp in logprobs)
        return Chunk(
            text=text,
            token_ids=d.new_token_ids,
            logprobs=logprobs,
            tokens=tokens,
            top_tokens=top_tokens,
        )

    def _token_str(self, token_id: int) -> str:
        if self._tokenizer is None:
            return ""
        # The token's own text (" world"), not its BPE spelling ("Ġworld"); a token that
        # is only part of a UTF-8 character decodes to U+FFFD, as the proto says.
        try:
            return self._tokenizer.decode([token_id])
        except (ValueError, OverflowError):
            return ""

    def _finish(self, d: RequestOutput, now: float) -> Event:
        if d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            return self._complete(d.finish_reason, "", d, now)
        # Aborts we asked for never come back; any other abort is the engine's doing.
        return EngineFault(f"the engine ended the request ({d.finish_reason})")

    def _complete(
        self, reason: FinishReason, matched: str, d: RequestOutput, now: float
    ) -> Complete:
        first_token = self.first_token if self.first_token is not None else now
        return Complete(
            finish_reason=reason,
            matched_stop=matched,
            usage=Usage(
                prompt_tokens=d.num_prompt_tokens or self.num_prompt_tokens,
                completion_tokens=d.num_output_tokens,
                cached_prompt_tokens=d.num_cached_tokens,
            ),
            timing=Timing(
                queue_seconds=max(0.0, (self.first_scheduled or now) - self.arrival),
                time_to_first_token_seconds=first_token - self.arrival,
                total_seconds=now - self.arrival,
                tokenize_seconds=self.tokenized - self.arrival,
                arrival=self.arrival,
            ),
        )
