"""``bench.kv_routing``'s workload and bookkeeping, without processes: the order really
defeats round robin, and the summary reads the records it is given. No timing is
asserted; the end-to-end run is the benchmark itself (it needs three replicas and SMG)."""

from __future__ import annotations

import argparse

from bench import kv_routing

ARGS = argparse.Namespace(prompts=16, turns=6, prefix_words=200)


def test_round_robin_over_three_replicas_sends_every_prompt_everywhere() -> None:
    items = kv_routing.workload(ARGS)
    assert len(items) == 16 * 6
    seen = {t: {k % 3 for k, (tenant, _) in enumerate(items) if tenant == t} for t in range(16)}
    assert all(replicas == {0, 1, 2} for replicas in seen.values())
    systems = {messages[0]["content"] for _, messages in items}
    assert len(systems) == 16 and min(len(s.split()) for s in systems) >= 200


def test_summary_counts_hits_and_follows_the_restarted_replicas_prompts() -> None:
    def record(tenant: int, worker: str, cached: int) -> dict:
        return {
            "tenant": tenant, "worker": worker, "ttft_s": 0.5, "e2e_s": 1.0,
            "prompt_tokens": 100, "cached_tokens": cached, "completion_tokens": 8,
        }  # fmt: skip

    before = [record(0, "a", 0), record(1, "b", 0), record(0, "a", 96), record(1, "b", 96)]
    after = [record(0, "a", 96), record(1, "b", 0), record(1, "c", 0), record(1, "b", 96)]
    summary = kv_routing.summarize(before, after, 8.0, "b", True)
    assert summary["hit_rate"] == round(4 * 96 / 800, 4)
    assert summary["hit_rate_after_restart"] == round(2 * 96 / 400, 4)
    orphans = summary["restarted_replica_prompts"]
    assert orphans["prompts"] == [1] and orphans["turns_after_restart"] == 3
    assert orphans["sent_to_restarted_replica"] == 2 and orphans["hits"] == 1
    assert summary["requests_s"] == 1.0
