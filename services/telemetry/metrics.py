"""Prometheus metrics of the serving pipeline, in a registry of their own.

The pipeline's stages update them (stage 3 mirrors the engine's stats snapshots and
records per-request latencies; the facade counts rejections); the server exposes
``registry`` on its HTTP side port (services/server/http_endpoint.py ``start_http``: its own
WSGI server, HTTPS with the gRPC certificate, ``/health`` beside ``/metrics``).
A private ``CollectorRegistry`` rather than the global one lets tests build many.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from compute.core.messages import EngineStats, StepTiming

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_STEP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_POW2 = tuple(float(2**i) for i in range(14))  # 1 .. 8192

# EngineStats cumulative fields mirrored as counters: field -> metric attribute.
_CUMULATIVE = {
    "prefix_cache_hit_tokens": "prefix_cache_hit_tokens",
    "num_preemptions": "preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "spec_draft_tokens": "spec_draft_tokens",
    "spec_accepted_tokens": "spec_accepted_tokens",
    "spec_emitted_tokens": "spec_emitted_tokens",
    "samples_forked": "samples_forked",
    "samples_not_forked": "samples_recomputed",
}


class Metrics:
    """Every headrace_* metric; thread-safe (prometheus_client locks internally)."""

    enabled = True  # NoMetrics (below) is the sink when they are off

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._add_engine_metrics(self.registry)
        self._add_request_metrics(self.registry)
        self._add_vllm_aliases(self.registry)
        self._add_step_metrics(self.registry)
        self._add_grammar_metrics(self.registry)
        self._last_cumulative = dict.fromkeys(_CUMULATIVE, 0)

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """Mirrors of the engine's stats snapshots, plus the step loop's idle share."""
        self.requests_running = Gauge(
            "headrace_requests_running", "Sequences running in the engine", registry=r
        )
        self.requests_waiting = Gauge(
            "headrace_requests_waiting", "Sequences waiting in the engine", registry=r
        )
        self.kv_cache_usage = Gauge(
            "headrace_kv_cache_usage_ratio",
            "Fraction of KV blocks owned by live sequences",
            registry=r,
        )
        self.step_loop_idle = Gauge(
            "headrace_step_loop_idle_ratio",
            "Fraction of busy wall time the step loop sat waiting for work",
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "headrace_prefix_cache_hit_tokens_total",
            "Prompt tokens served by the prefix cache",
            registry=r,
        )
        self.preemptions = Counter(
            "headrace_preemptions_total", "Sequences preempted for lack of KV blocks", registry=r
        )
        self.prompt_tokens = Counter(
            "headrace_prompt_tokens_total", "Prompt tokens computed", registry=r
        )
        self.generation_tokens = Counter(
            "headrace_generation_tokens_total", "Tokens sampled", registry=r
        )
        # Speculative decoding: acceptance rate = accepted / draft; tokens per verifying
        # step and sequence = emitted / (emitted - accepted).
        self.spec_draft_tokens = Counter(
            "headrace_spec_decode_draft_tokens_total",
            "Speculative draft tokens scored",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "headrace_spec_decode_accepted_tokens_total",
            "Speculative draft tokens accepted",
            registry=r,
        )
        self.spec_emitted_tokens = Counter(
            "headrace_spec_decode_emitted_tokens_total",
            "Tokens emitted by steps that verified a draft (accepted + one each)",
            registry=r,
        )
        # n > 1: the samples after the first, by how their prompt's K/V was had.
        samples = Counter(
            "headrace_samples_admitted_total",
            "Extra samples of n > 1 requests admitted: forked (the first sample's prompt KV "
            "blocks shared, one token computed) or recomputed (it had ended or was not "
            "running: prefix-cache hits and the rest computed)",
            ["admission"],
            registry=r,
        )
        self.samples_forked = samples.labels(admission="forked")
        self.samples_recomputed = samples.labels(admission="recomputed")

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Per-request outcomes and latencies, recorded by stage 3 and the facade."""
        self.requests_finished = Counter(
            "headrace_requests_finished_total",
            "Requests that ended, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "headrace_requests_rejected_total",
            "Requests refused before running, by reason",
            ["reason"],
            registry=r,
        )
        self.queue_time = Histogram(
            "headrace_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "headrace_time_to_first_token_seconds",
            "Arrival to first token chunk",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "headrace_inter_token_latency_seconds",
            "Time between token chunks of a request, per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "headrace_prefill_time_seconds",
            "First scheduled to first token chunk",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "headrace_decode_time_seconds",
            "First token chunk to the end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "headrace_e2e_request_latency_seconds",
            "Arrival to the last event",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _add_vllm_aliases(self, r: CollectorRegistry) -> None:
        """vLLM's names for the load signals routers read by default (the Gateway API
        Inference Extension's model-server protocol, llm-d, SMG): same values as the
        headrace_* gauges."""
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Alias of headrace_requests_waiting", registry=r
        )
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Alias of headrace_requests_running", registry=r
        )
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Alias of headrace_kv_cache_usage_ratio (a fraction in [0, 1], as vLLM's)",
            registry=r,
        )
        self.vllm_cache_config = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration (labels); the value is always 1",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """vllm:cache_config_info{block_size, num_gpu_blocks} (num_gpu_blocks = KV blocks,
        whatever the device)."""
        self.vllm_cache_config.labels(
            block_size=str(block_size), num_gpu_blocks=str(num_blocks)
        ).set(1)

    def _add_step_metrics(self, r: CollectorRegistry) -> None:
        """Per engine step, from the StepTiming the step loop attaches (stage 3 observes)."""
        phase = "Seconds per engine step spent in "
        self.step_schedule = Histogram("headrace_step_schedule_seconds", phase + "scheduling",
                                       buckets=_STEP_BUCKETS, registry=r)  # fmt: skip
        self.step_forward = Histogram("headrace_step_forward_seconds", phase + "the forward pass",
                                      buckets=_STEP_BUCKETS, registry=r)  # fmt: skip
        self.step_sample = Histogram(
            "headrace_step_sample_seconds", phase + "sampling and the scheduler update",
            buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_idle = Histogram(
            "headrace_step_idle_seconds",
            "Seconds the step loop waited for input before a step while requests were live",
            buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_batch_size = Histogram("headrace_step_batch_size", "Sequences per engine step",
                                         buckets=_POW2, registry=r)  # fmt: skip
        self.step_tokens = Histogram("headrace_step_tokens", "Tokens computed per engine step",
                                     buckets=_POW2, registry=r)  # fmt: skip

    def _add_grammar_metrics(self, r: CollectorRegistry) -> None:
        """Grammar constraints (compute/sampling/grammar_masks.py,
        services/pipeline/grammar_compile.py)."""
        self.constrained_requests = Counter(
            "headrace_constrained_requests", "Requests admitted with a grammar constraint",
            ["kind"], registry=r,
        )  # fmt: skip
        self.grammar_compile = Histogram(
            "headrace_grammar_compile_seconds",
            "Seconds to compile a constraint (outcome: compiled, cached, invalid, timeout, error)",
            ["outcome"], buckets=_STEP_BUCKETS + (5.0, 10.0), registry=r,
        )  # fmt: skip
        self.grammar_mask = Histogram(
            "headrace_grammar_mask_seconds",
            "Seconds per engine step computing the grammar masks of its constrained rows",
            buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_constrained(self, kind: str) -> None:
        self.constrained_requests.labels(kind=kind).inc()

    def observe_grammar_compile(self, outcome: str, seconds: float) -> None:
        self.grammar_compile.labels(outcome=outcome).observe(seconds)

    def observe_step(self, timing: StepTiming) -> None:
        self.step_schedule.observe(timing.schedule_s)
        self.step_forward.observe(timing.forward_s)
        self.step_sample.observe(timing.sample_s)
        self.step_idle.observe(timing.idle_s)
        self.step_batch_size.observe(timing.num_seqs)
        self.step_tokens.observe(timing.num_tokens)
        if timing.mask_s > 0.0:  # steps with a constrained row only
            self.grammar_mask.observe(timing.mask_s)

    def observe_engine_stats(self, stats: EngineStats) -> None:
        """Mirror one snapshot; call from one thread only (it diffs cumulative counts)."""
        for running in (self.requests_running, self.vllm_running):
            running.set(stats.num_running)
        for waiting in (self.requests_waiting, self.vllm_waiting):
            waiting.set(stats.num_waiting)
        for usage in (self.kv_cache_usage, self.vllm_kv_usage):
            usage.set(stats.kv_usage)
        for field, attr in _CUMULATIVE.items():
            value = getattr(stats, field)
            delta = value - self._last_cumulative[field]
            if delta > 0:  # an engine restart would reset its counts: never decrement
                getattr(self, attr).inc(delta)
            self._last_cumulative[field] = value

    def observe_first_token(self, queue_seconds: float, ttft_seconds: float) -> None:
        self.queue_time.observe(max(0.0, queue_seconds))
        self.ttft.observe(ttft_seconds)
        self.prefill_time.observe(max(0.0, ttft_seconds - max(0.0, queue_seconds)))

    def observe_decode(self, seconds: float) -> None:
        self.decode_time.observe(max(0.0, seconds))

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        per_token = seconds / max(1, num_tokens)
        for _ in range(num_tokens):
            self.inter_token_latency.observe(per_token)

    def observe_finished(self, finish_reason: str, e2e_seconds: float | None = None) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        if e2e_seconds is not None:
            self.e2e_latency.observe(e2e_seconds)

    def observe_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason=reason).inc()

    def bind_step_loop_idle_ratio(self, fraction: Callable[[], float]) -> None:
        """Evaluate the step loop's idle fraction at scrape time."""
        self.step_loop_idle.set_function(fraction)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _dropped(self: Metrics, *args: object, **kwargs: object) -> None:
    """An observation nobody records."""


class NoMetrics(Metrics):
    """The sink when metrics are off: it takes every observation and records none, so
    callers never ask whether metrics are on. It has no registry to serve."""

    enabled = False
    __init__ = set_cache_config = observe_step = observe_engine_stats = _dropped
    observe_first_token = observe_decode = observe_inter_token = _dropped
    observe_finished = observe_rejected = bind_step_loop_idle_ratio = _dropped
    observe_constrained = observe_grammar_compile = _dropped


NO_METRICS = NoMetrics()
