"""min_tokens in the scheduler: no stop token ends a request before it (the sampler masks
them, compute/sampling/logit_processors.py; a token that still comes through is not a stop), and no
draft is made for it meanwhile (each draft position would need its own mask)."""

from __future__ import annotations

from compute.core.config import SpeculativeConfig
from compute.core.messages import FinishReason
from tests.core.test_scheduler import EOS, Harness, _scripted


def test_no_stop_token_ends_a_request_before_min_tokens() -> None:
    h = Harness()
    h.add("a", 3, max_tokens=6, params={"min_tokens": 2, "stop_token_ids": (77,)})
    results = []
    for token in (EOS, 77, EOS):
        out = h.sched.schedule()
        results += h.sched.update_from_output(out, _scripted(out, token))
    assert [r.finished for r in results] == [False, False, True]
    assert results[-1].finish_reason is FinishReason.STOP and results[-1].num_output_tokens == 3


def test_no_draft_before_min_tokens() -> None:
    h = Harness()
    h.sched.drafts.config = SpeculativeConfig(method="ngram", num_tokens=2)
    h.sched.drafts.proposer = lambda seq, k: [5] * k
    seq = h.add("a", 3, max_tokens=8, params={"min_tokens": 3})
    drafts = []
    for _ in range(4):
        out = h.sched.schedule()
        drafts += [item.draft_token_ids for item in out.scheduled]
        h.sched.update_from_output(out, _scripted(out, 9))
    # Prefill, then decodes at 1 and 2 output tokens: no draft; at 3 (min_tokens) drafts.
    assert drafts[:3] == [(), (), ()] and drafts[3] == (5, 5)
    assert seq.num_output_tokens >= 4
