"""The Prometheus exposition parses and carries every headrace_* metric."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from compute.core.messages import EngineStats, StepTiming
from services.telemetry.metrics import Metrics

EXPECTED_SAMPLES = {
    "headrace_requests_running",
    "headrace_requests_waiting",
    "headrace_kv_cache_usage_ratio",
    "headrace_step_loop_idle_ratio",
    "headrace_prefix_cache_hit_tokens_total",
    "headrace_preemptions_total",
    "headrace_prompt_tokens_total",
    "headrace_generation_tokens_total",
    "headrace_requests_finished_total",
    "headrace_requests_rejected_total",
    "headrace_queue_time_seconds_count",
    "headrace_time_to_first_token_seconds_count",
    "headrace_inter_token_latency_seconds_count",
    "headrace_e2e_request_latency_seconds_count",
    "headrace_prefill_time_seconds_count",
    "headrace_decode_time_seconds_count",
    "headrace_step_schedule_seconds_count",
    "headrace_step_forward_seconds_count",
    "headrace_step_sample_seconds_count",
    "headrace_step_idle_seconds_count",
    "headrace_step_batch_size_count",
    "headrace_step_tokens_count",
}


def stats(**overrides: float) -> EngineStats:
    base = dict(
        num_running=3, num_waiting=2, num_swapped=0, num_blocks=100, num_free_blocks=60,
        block_size=16, kv_usage=0.4, kv_slots_allocated=640, kv_slots_used=600,
        num_preemptions=1, prefix_cache_hit_tokens=32, prompt_tokens=100, generation_tokens=50,
    )  # fmt: skip
    return EngineStats(**{**base, **overrides})


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exposition_parses_and_has_every_metric() -> None:
    metrics = Metrics()
    metrics.bind_step_loop_idle_ratio(lambda: 0.25)
    metrics.observe_engine_stats(stats())
    metrics.observe_first_token(0.01, 0.05)
    metrics.observe_inter_token(0.02, 2)
    metrics.observe_finished("length", 1.5)
    metrics.observe_rejected("resource_exhausted")
    found = samples(metrics)
    assert not EXPECTED_SAMPLES - {name for name, _ in found}
    assert found[("headrace_step_loop_idle_ratio", ())] == 0.25
    assert found[("headrace_requests_running", ())] == 3
    assert found[("headrace_kv_cache_usage_ratio", ())] == 0.4
    assert found[("headrace_requests_finished_total", (("finish_reason", "length"),))] == 1
    assert found[("headrace_requests_rejected_total", (("reason", "resource_exhausted"),))] == 1
    assert found[("headrace_inter_token_latency_seconds_count", ())] == 2


def test_cumulative_engine_stats_become_counter_increments() -> None:
    metrics = Metrics()
    metrics.observe_engine_stats(stats(generation_tokens=50, num_preemptions=1))
    metrics.observe_engine_stats(stats(generation_tokens=80, num_preemptions=1))
    found = samples(metrics)
    assert found[("headrace_generation_tokens_total", ())] == 80
    assert found[("headrace_preemptions_total", ())] == 1
    assert found[("headrace_prefix_cache_hit_tokens_total", ())] == 32


def test_speculative_decoding_counters() -> None:
    metrics = Metrics()
    metrics.observe_engine_stats(stats())
    metrics.observe_engine_stats(
        stats(spec_draft_tokens=40, spec_accepted_tokens=30, spec_emitted_tokens=40)
    )
    found = samples(metrics)
    assert found[("headrace_spec_decode_draft_tokens_total", ())] == 40
    assert found[("headrace_spec_decode_accepted_tokens_total", ())] == 30
    assert found[("headrace_spec_decode_emitted_tokens_total", ())] == 40


def test_sample_admission_counters() -> None:
    metrics = Metrics()
    metrics.observe_engine_stats(stats())
    metrics.observe_engine_stats(stats(samples_forked=5, samples_not_forked=1))
    found = samples(metrics)
    assert found[("headrace_samples_admitted_total", (("admission", "forked"),))] == 5
    assert found[("headrace_samples_admitted_total", (("admission", "recomputed"),))] == 1


def test_registries_are_independent() -> None:
    first, second = Metrics(), Metrics()
    first.observe_rejected("unavailable")
    assert ("headrace_requests_rejected_total", (("reason", "unavailable"),)) in samples(first)
    assert ("headrace_requests_rejected_total", (("reason", "unavailable"),)) not in samples(second)


def test_step_timing_and_request_phases_become_histograms() -> None:
    metrics = Metrics()
    metrics.observe_step(StepTiming(0.001, 0.02, 0.003, 0.004, num_seqs=5, num_tokens=133))
    metrics.observe_first_token(queue_seconds=0.25, ttft_seconds=1.0)
    metrics.observe_decode(2.0)
    found = samples(metrics)
    assert found[("headrace_step_forward_seconds_sum", ())] == 0.02
    assert found[("headrace_step_idle_seconds_sum", ())] == 0.004
    assert found[("headrace_step_batch_size_sum", ())] == 5
    assert found[("headrace_step_tokens_bucket", (("le", "128.0"),))] == 0
    assert found[("headrace_step_tokens_bucket", (("le", "256.0"),))] == 1
    assert found[("headrace_prefill_time_seconds_sum", ())] == 0.75  # ttft - queue
    assert found[("headrace_decode_time_seconds_sum", ())] == 2.0


def test_a_served_request_fills_the_step_and_phase_histograms(served) -> None:
    from services.client.client import Client, generate_request

    with Client(served.target, timeout=30) as client:
        for i in range(3):
            list(client.generate(generate_request("hi", max_tokens=4, request_id=f"r{i}")))
    found = samples(served.metrics)
    assert found[("headrace_step_batch_size_count", ())] >= 4
    assert found[("headrace_step_tokens_sum", ())] >= 12
    assert found[("headrace_prefill_time_seconds_count", ())] == 3
    assert found[("headrace_decode_time_seconds_count", ())] == 3


def test_grammar_metrics_count_constrained_requests_compiles_and_mask_time() -> None:
    metrics = Metrics()
    metrics.observe_constrained("json_schema")
    metrics.observe_grammar_compile("compiled", 0.002)
    metrics.observe_grammar_compile("cached", 0.0)
    metrics.observe_step(StepTiming(0.001, 0.02, 0.003, 0.0, num_seqs=2, num_tokens=2))
    metrics.observe_step(StepTiming(0.001, 0.02, 0.003, 0.0, 2, 2, mask_s=0.0005))
    found = samples(metrics)
    assert found[("headrace_constrained_requests_total", (("kind", "json_schema"),))] == 1
    assert found[("headrace_grammar_compile_seconds_count", (("outcome", "compiled"),))] == 1
    assert found[("headrace_grammar_compile_seconds_count", (("outcome", "cached"),))] == 1
    assert found[("headrace_grammar_mask_seconds_count", ())] == 1  # unconstrained steps: none
    assert found[("headrace_grammar_mask_seconds_sum", ())] == 0.0005


def test_no_metrics_takes_every_observation_and_records_none() -> None:
    # Every public method of Metrics must be dropped by the sink: one added to Metrics and
    # not overridden would run on an object with no registry, and fail only when metrics
    # are off.
    import inspect

    from services.telemetry.metrics import NO_METRICS, NoMetrics

    methods = [
        name
        for name, value in vars(Metrics).items()
        if inspect.isfunction(value) and not name.startswith("_") and name != "render"
    ]
    assert len(methods) >= 10
    for name in methods:
        arity = len(inspect.signature(getattr(Metrics, name)).parameters) - 1
        assert getattr(NO_METRICS, name)(*[None] * arity) is None, name
        assert getattr(NoMetrics, name) is not getattr(Metrics, name), name
    assert not hasattr(NO_METRICS, "registry") and NO_METRICS.enabled is False
