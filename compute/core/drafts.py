"""The speculative draft policy: which decoding sequence gets a draft, and what a verified
draft's outcome does to its sequence's pacing and to the counters.

The scheduler asks ``propose`` for each decode it schedules and hands ``accepted`` the
tokens a verified draft emitted; it appends the tokens itself (compute/core/scheduler.py).
Drafts are made only while at most ``max_batch`` sequences run, for requests whose sampling
reads no history (``SamplingParams.reads_history``: penalties and grammars would need the
unaccepted draft as history) and whose ``min_tokens`` is met (the stop tokens are banned
once per position), when the budget, the request's remaining length and the model's
context leave room. A draft the model wholly rejects costs a wider step for nothing, so
its sequence then pauses drafting for 1, 2, 4 ... up to ``MAX_DRAFT_BACKOFF`` decode steps
(doubling while drafts keep missing, reset by any accepted token).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from compute.core.config import SpeculativeConfig
from compute.core.ngram import NgramIndex
from compute.core.sequence import Sequence

MAX_DRAFT_BACKOFF = 8  # the longest pause in drafting after wholly rejected drafts (steps)


class DraftPolicy:
    """Drafts for decoding sequences, their pacing, and cumulative counts."""

    def __init__(self, speculative: SpeculativeConfig, max_model_len: int) -> None:
        self.config = speculative
        self.max_model_len = max_model_len
        # (sequence, at most k) -> draft tokens to follow it; tests may put their own here.
        self.proposer: Callable[[Sequence, int], list[int]] = self._ngram_draft
        # Cumulative: draft tokens scored, those accepted, and the tokens emitted by the
        # steps that verified a draft (accepted + one each).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_emitted_tokens = 0

    def propose(self, seq: Sequence, budget: int, num_running: int) -> tuple[int, ...]:
        """Draft tokens for a decoding ``seq`` this step (empty: none)."""
        if not self._may_draft(seq, num_running):
            return ()
        if seq.draft_skip > 0:  # backing off after wholly rejected drafts
            seq.draft_skip -= 1
            return ()
        # Room for the draft and one more token: in the budget, in max_tokens, in the model.
        params = seq.sampling_params
        room = min(
            self.config.num_tokens,
            budget - 1,
            params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return ()
        return tuple(self.proposer(seq, room)[:room])

    def _ngram_draft(self, seq: Sequence, num_tokens: int) -> list[int]:
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return seq.ngrams.propose(seq, num_tokens)

    def _may_draft(self, seq: Sequence, num_running: int) -> bool:
        params = seq.sampling_params
        return (
            self.config.enabled
            and num_running <= self.config.max_batch
            and not seq.num_pending
            and not params.reads_history
            and seq.num_output_tokens >= params.min_tokens
        )

    def accepted(self, seq: Sequence, draft: tuple[int, ...], emitted: list[int]) -> int:
        """How many of ``draft`` a verified step accepted, given the tokens it ``emitted``
        (draft[i] counts when the token before it equals it); updates the counters and
        ``seq``'s pacing. ValueError when ``emitted`` does not hold one token per accepted
        draft token plus the model's own."""
        accepted = 0
        while accepted < len(draft) and emitted[accepted] == draft[accepted]:
            accepted += 1
        if len(emitted) != accepted + 1:
            raise ValueError(
                f"runner output for {seq.request_id}: {len(emitted) - 1} tokens after the "
                f"first, {accepted} draft tokens accepted"
            )
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        self.num_spec_emitted_tokens += 1 + accepted
        if accepted:
            seq.draft_backoff = 0
        else:
            seq.draft_backoff = min(MAX_DRAFT_BACKOFF, 2 * seq.draft_backoff or 1)
            seq.draft_skip = seq.draft_backoff
        return accepted
