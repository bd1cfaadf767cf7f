"""Prometheus metrics of the serving pipeline, in a registry of their own.

The pipeline's stages update them (stage 3 mirrors the engine's stats snapshots and
records per-request latencies; the facade counts rejections); the server exposes
``registry`` on its HTTP side port (services/server/http_endpoint.py ``start_http``: its own
WSGI server, HTTPS with the gRPC certificate, ``/health`` beside ``/metrics``).
A private ``CollectorRegistry`` rather than the global one lets tests build many.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Spec:
    """One metric: the Metrics attribute that holds it, and how it is registered."""

    attr: str
    kind: type[Gauge] | type[Counter] | type[Histogram]
    name: str
    help: str
    buckets: tuple[float, ...] = ()  # histograms only
    labels: tuple[str, ...] = ()


_STEP = "Seconds per engine step spent in "
_METRICS = (
    # Mirrors of the engine's stats snapshots, plus the step loop's idle share.
    _Spec("requests_running", Gauge, "headrace_requests_running",
          "Sequences running in the engine"),
    _Spec("requests_waiting", Gauge, "headrace_requests_waiting",
          "Sequences waiting in the engine"),
    _Spec("kv_cache_usage", Gauge, "headrace_kv_cache_usage_ratio",
          "Fraction of KV blocks owned by live sequences"),
    _Spec("step_loop_idle", Gauge, "headrace_step_loop_idle_ratio",
          "Fraction of busy wall time the step loop sat waiting for work"),
    _Spec("prefix_cache_hit_tokens", Counter, "headrace_prefix_cache_hit_tokens_total",
          "Prompt tokens served by the prefix cache"),
    _Spec("preemptions", Counter, "headrace_preemptions_total",
          "Sequences preempted for lack of KV blocks"),
    _Spec("prompt_tokens", Counter, "headrace_prompt_tokens_total", "Prompt tokens computed"),
    _Spec("generation_tokens", Counter, "headrace_generation_tokens_total", "Tokens sampled"),
    # Speculative decoding: acceptance rate = accepted / draft; tokens per verifying step
    # and sequence = emitted / (emitted - accepted).
    _Spec("spec_draft_tokens", Counter, "headrace_spec_decode_draft_tokens_total",
          "Speculative draft tokens scored"),
    _Spec("spec_accepted_tokens", Counter, "headrace_spec_decode_accepted_tokens_total",
          "Speculative draft tokens accepted"),
    _Spec("spec_emitted_tokens", Counter, "headrace_spec_decode_emitted_tokens_total",
          "Tokens emitted by steps that verified a draft (accepted + one each)"),
    # n > 1: the samples after the first, by how their prompt's K/V was had.
    _Spec("samples_admitted", Counter, "headrace_samples_admitted_total",
          "Extra samples of n > 1 requests admitted: forked (the first sample's prompt KV "
          "blocks shared, one token computed) or recomputed (it had ended or was not "
          "running: prefix-cache hits and the rest computed)", labels=("admission",)),
    # Per-request outcomes and latencies, recorded by stage 3 and the facade.
    _Spec("requests_finished", Counter, "headrace_requests_finished_total",
          "Requests that ended, by finish reason", labels=("finish_reason",)),
    _Spec("requests_rejected", Counter, "headrace_requests_rejected_total",
          "Requests refused before running, by reason", labels=("reason",)),
    _Spec("queue_time", Histogram, "headrace_queue_time_seconds", "Arrival to first scheduled",
          _LATENCY_BUCKETS),
    _Spec("ttft", Histogram, "headrace_time_to_first_token_seconds",
          "Arrival to first token chunk", _LATENCY_BUCKETS),
    _Spec("inter_token_latency", Histogram, "headrace_inter_token_latency_seconds",
          "Time between token chunks of a request, per token", _ITL_BUCKETS),
    _Spec("prefill_time", Histogram, "headrace_prefill_time_seconds",
          "First scheduled to first token chunk", _LATENCY_BUCKETS),
    _Spec("decode_time", Histogram, "headrace_decode_time_seconds", "First token chunk to the end",
          _LATENCY_BUCKETS),
    _Spec("e2e_latency", Histogram, "headrace_e2e_request_latency_seconds",
          "Arrival to the last event", _LATENCY_BUCKETS),
    # vLLM's names for the load signals routers read by default (the Gateway API Inference
    # Extension's model-server protocol, llm-d, SMG): same values as the headrace_* gauges.
    _Spec("vllm_waiting", Gauge, "vllm:num_requests_waiting", "Alias of headrace_requests_waiting"),
    _Spec("vllm_running", Gauge, "vllm:num_requests_running", "Alias of headrace_requests_running"),
    _Spec("vllm_kv_usage", Gauge, "vllm:kv_cache_usage_perc",
          "Alias of headrace_kv_cache_usage_ratio (a fraction in [0, 1], as vLLM's)"),
    _Spec("vllm_cache_config", Gauge, "vllm:cache_config_info",
          "KV cache configuration (labels); the value is always 1",
          labels=("block_size", "num_gpu_blocks")),
    # Per engine step, from the StepTiming the step loop attaches (stage 3 observes).
    _Spec("step_schedule", Histogram, "headrace_step_schedule_seconds", _STEP + "scheduling",
          _STEP_BUCKETS),
    _Spec("step_forward", Histogram, "headrace_step_forward_seconds", _STEP + "the forward pass",
          _STEP_BUCKETS),
    _Spec("step_sample", Histogram, "headrace_step_sample_seconds",
          _STEP + "sampling and the scheduler update", _STEP_BUCKETS),
    _Spec("step_idle", Histogram, "headrace_step_idle_seconds",
          "Seconds the step loop waited for input before a step while requests were live",
          _STEP_BUCKETS),
    _Spec("step_batch_size", Histogram, "headrace_step_batch_size", "Sequences per engine step",
          _POW2),
    _Spec("step_tokens", Histogram, "headrace_step_tokens", "Tokens computed per engine step",
          _POW2),
    # Grammar constraints (compute/sampling/grammar_masks.py,
    # services/pipeline/grammar_compile.py).
    _Spec("constrained_requests", Counter, "headrace_constrained_requests",
          "Requests admitted with a grammar constraint", labels=("kind",)),
    _Spec("grammar_compile", Histogram, "headrace_grammar_compile_seconds",
          "Seconds to compile a constraint (outcome: compiled, cached, invalid, timeout, error)",
          _STEP_BUCKETS + (5.0, 10.0), ("outcome",)),
    _Spec("grammar_mask", Histogram, "headrace_grammar_mask_seconds",
          "Seconds per engine step computing the grammar masks of its constrained rows",
          _STEP_BUCKETS),
    # The worker protocol's KV-event stream (services/pipeline/kv_event_hub.py).
    _Spec("kv_event_subscribers", Gauge, "headrace_kv_event_subscribers",
          "KV-event streams open (SubscribeKvEvents)"),
    _Spec("kv_events_published", Counter, "headrace_kv_events_published_total",
          "Prefix-cache events the block manager emitted (kind: stored, removed)",
          labels=("kind",)),
    _Spec("kv_event_batches_sent", Counter, "headrace_kv_event_batches_sent_total",
          "KV-event batches sent over all streams (kind: events, snapshot, load_only)",
          labels=("kind",)),
    _Spec("kv_events_sent", Counter, "headrace_kv_events_sent_total",
          "KV events sent over all streams (snapshots included)"),
    _Spec("kv_event_subscribers_dropped", Counter, "headrace_kv_event_subscribers_dropped_total",
          "KV-event subscribers dropped for falling behind (their queue was full)",
          labels=("reason",)),
    _Spec("kv_event_resyncs", Counter, "headrace_kv_event_resyncs_total",
          "KV-event subscribers sent the whole cache state (reason: snapshot, a fresh "
          "subscription) or told to resync (cursor_expired: OUT_OF_RANGE)", labels=("reason",)),
)  # fmt: skip

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


def _register(spec: _Spec, registry: CollectorRegistry) -> Gauge | Counter | Histogram:
    extra = {"buckets": spec.buckets} if spec.buckets else {}
    return spec.kind(spec.name, spec.help, list(spec.labels), registry=registry, **extra)


class Metrics:
    """Every headrace_* metric; thread-safe (prometheus_client locks internally)."""

    enabled = True  # NoMetrics (below) is the sink when they are off

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for spec in _METRICS:
            setattr(self, spec.attr, _register(spec, self.registry))
        self.samples_forked = self.samples_admitted.labels(admission="forked")
        self.samples_recomputed = self.samples_admitted.labels(admission="recomputed")
        self._last_cumulative = dict.fromkeys(_CUMULATIVE, 0)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """vllm:cache_config_info{block_size, num_gpu_blocks} (num_gpu_blocks = KV blocks,
        whatever the device)."""
        self.vllm_cache_config.labels(
            block_size=str(block_size), num_gpu_blocks=str(num_blocks)
        ).set(1)

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

    def observe_kv_subscribers(self, count: int) -> None:
        self.kv_event_subscribers.set(count)

    def observe_kv_published(self, stored: int, removed: int) -> None:
        self.kv_events_published.labels(kind="stored").inc(stored)
        self.kv_events_published.labels(kind="removed").inc(removed)

    def observe_kv_batch_sent(self, kind: str, num_events: int) -> None:
        self.kv_event_batches_sent.labels(kind=kind).inc()
        self.kv_events_sent.inc(num_events)

    def observe_kv_subscriber_dropped(self, reason: str) -> None:
        self.kv_event_subscribers_dropped.labels(reason=reason).inc()

    def observe_kv_resync(self, reason: str) -> None:
        self.kv_event_resyncs.labels(reason=reason).inc()

    def bind_step_loop_idle_ratio(self, fraction: Callable[[], float]) -> None:
        """Evaluate the step loop's idle fraction at scrape time."""
        self.step_loop_idle.set_function(fraction)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _dropped(self: Metrics, *args: object, **kwargs: object) -> None:
    """An observation nobody records."""


def _sink(cls: type[Metrics]) -> type[Metrics]:
    """Every public method of Metrics (and __init__) replaced by one that drops its call."""
    for name, value in vars(Metrics).items():
        if callable(value) and not name.startswith("_") and name != "render":
            setattr(cls, name, _dropped)
    cls.__init__ = _dropped  # type: ignore[method-assign]
    return cls


@_sink
class NoMetrics(Metrics):
    """The sink when metrics are off: it takes every observation and records none, so
    callers never ask whether metrics are on. It has no registry to serve."""

    enabled = False


NO_METRICS = NoMetrics()
