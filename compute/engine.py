"""The engine: scheduler + model runner behind a step-wise and an offline API.

One step = schedule -> build the flat batch -> forward -> sample -> update
sequences. Stage 2 (compute/step_loop.py) drives ``add_request``/``step``/
``abort``; ``generate`` is the offline API built on the same calls.

Asynchronous output (``DeviceConfig.async_output``, on by default for CUDA): ``step``
schedules and launches step N+1 while step N's work is still queued on the device, and
only then waits for step N's sampled ids (a copy into pinned memory behind step N, not
behind N+1) and returns step N's outputs. The scheduler sees step N's tokens as
placeholders meanwhile (compute/core/scheduler.py), and the runner feeds them to step N+1
from the device. So the GPU never idles while Python schedules, and every output comes
one step later than in synchronous mode. A request that step N finishes (EOS, a stop
token) or that is aborted has run step N+1 for nothing: that token is dropped and its
blocks were freed once, at the finish. A step whose sequences' sampling reads their
history (penalties) waits for the step before it, as does a launch that fails.

Speculative decoding (``SpeculativeConfig``, compute/core/scheduler.py) runs with
synchronous output only: a step's accepted count decides the next step's inputs, so the
next step cannot be scheduled before it is known. Asked for together with
``async_output=True`` it is an error at load; with ``async_output`` left to auto, output
is synchronous (logged).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from compute.core.checks import RequestLimits
from compute.core.config import EngineConfig, ModelConfig
from compute.core.kv_events import KvEvent
from compute.core.messages import (
    EngineStats,
    FinishReason,
    RequestOutput,
    StepTiming,
    TokenLogprob,
)
from compute.core.outputs import SchedulerOutput
from compute.core.sampling_params import SamplingParams
from compute.core.scheduler import Scheduler
from compute.core.sequence import Sequence
from compute.device.memory_report import log_memory
from compute.device.selection import building_threads, cpu_execution, resolve_device
from compute.loaders import LoadedModel, load_model, read_template_flag, with_chat_template
from compute.models.decoder import DecoderModel
from compute.runner.model_runner import (
    ModelRunner,
    blocks_for_memory,
    default_num_blocks,
    kv_cache_dtype,
)
from compute.runner.step_result import StepResult
from kernels import ops
from kernels.log import get_logger

log = get_logger(__name__)


@dataclass
class CompletionOutput:
    """A finished request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer (dummy weights)
    finish_reason: FinishReason
    logprobs: list[TokenLogprob | None]
    num_cached_tokens: int


class Engine:
    """Continuous-batching engine over one model. Not thread-safe: one owner (stage 2)."""

    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        self.config = config
        device, dtype = resolve_device(config.device.device, config.device.dtype)
        with building_threads(config.device, device):
            self._build(config, device, dtype, loaded)

    def _build(self, config: EngineConfig, device, dtype, loaded: LoadedModel | None) -> None:
        self.device, self.dtype = device, dtype
        model = self._build_model(config, loaded)
        self._build_cache(config, model)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.model_config.eos_token_ids),
            num_host_blocks=self.num_host_blocks,
            vocab_size=self.model_config.vocab_size,
            speculative=config.speculative,
        )
        self.async_output = _async_output(config, device)
        self._log_speculative(config)
        self._in_flight: tuple[SchedulerOutput, StepResult] | None = None  # launched, unread
        self._ids = itertools.count()
        self._failed: list[tuple[str, str]] = []
        self._prompt_tokens = 0
        self.last_step_timing: StepTiming | None = None  # of the latest step()
        self._generation_tokens = 0

    def _build_model(self, config: EngineConfig, loaded: LoadedModel | None) -> DecoderModel:
        """The model on self.device, checked against the kernels that will run it (so a model
        they cannot serve fails now, not at the first step); sets the model's config,
        tokenizer, length limit, weights mode and KV dtype."""
        device, dtype = self.device, self.dtype
        native, weights = cpu_execution(config.device, device, dtype)
        # An operator's template is checked before minutes of weight loading, applied after.
        template = read_template_flag(config.chat_template) if config.chat_template else None
        if loaded is None:
            loaded = load_model(
                config.model,
                dtype=dtype,
                device=device,
                seed=config.seed,
                quantized=weights != "dense",
            )
        if template is not None:
            loaded = with_chat_template(loaded, template)
        cfg = loaded.config
        self.model_config = cfg
        self.tokenizer = loaded.tokenizer
        self.max_model_len = _max_model_len(config.scheduler.max_model_len, cfg)
        heads = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        ops.check_backend(device, dtype, *heads, config.cache.block_size, native_cpu=native)
        model = DecoderModel(cfg, loaded.weights, native=native, int8=weights == "quantized-int8")
        # What took effect: a source without GGUF blocks (HF, dummy) loads dense anyway.
        self.weights = weights if model.quantized else "dense"
        self.kv_dtype = kv_cache_dtype(config.cache, device, dtype, self.weights, cfg.head_dim)
        log.info(
            "model ready", cpu_kernels=native, weights=self.weights,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
        )  # fmt: skip
        loaded.weights.clear()  # the model holds its own (fused) copies now
        return model

    def _build_cache(self, config: EngineConfig, model: DecoderModel) -> None:
        """The KV cache's blocks (device and, for swap preemption, host) and the runner that
        owns them and the model."""
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or default_num_blocks(
            config, self.model_config, self.device, self.kv_dtype, self.max_model_len
        )
        self.num_host_blocks = 0
        if config.scheduler.preemption_mode == "swap":
            self.num_host_blocks = blocks_for_memory(
                self.model_config, config.cache, config.cache.swap_space_gib, self.kv_dtype
            )
        self.runner = ModelRunner(
            model, config.cache, self.num_blocks, self.num_host_blocks, config.seed, self.kv_dtype
        )
        self.runner.capture_graphs(
            config.device.cuda_graphs, config.scheduler.max_num_seqs, self.max_model_len
        )
        self.memory = log_memory(model, self.runner)  # one 'memory' log line: where RSS goes

    def _log_speculative(self, config: EngineConfig) -> None:
        spec = config.speculative
        if spec.enabled:
            log.info(
                "speculative decoding",
                method=spec.method,
                num_speculative_tokens=spec.num_tokens,
                ngram_min=spec.ngram_min,
                ngram_max=spec.ngram_max,
                max_batch=spec.max_batch,
                async_output=self.async_output,
            )

    @property
    def max_num_seqs(self) -> int:
        """Most sequences one step runs (the admission window a gateway routes by)."""
        return self.config.scheduler.max_num_seqs

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose decode steps replay a captured graph (empty: none)."""
        return self.runner.graph_batch_sizes

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        fork_of: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. FieldError naming the field if it can never be served.
        ``fork_of``: a request of the same prompt whose prompt K/V it may share (n > 1);
        ``cache_salt``: its prefix-cache namespace (shared only within the same salt)."""
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            fork_of=fork_of,
            cache_salt=cache_salt or None,
        )
        self.scheduler.add_request(seq)

    # -- the prefix cache's events and operations (stage 2 calls these) ----------------

    def record_kv_events(self, on: bool = True) -> None:
        """Record the blocks the prefix cache publishes and forgets (``take_kv_events``);
        off by default, so that drivers that never take them keep none."""
        caching = self.config.cache.enable_prefix_caching
        self.scheduler.kv_manager.kv_events.enabled = on and caching

    def take_kv_events(self) -> tuple[KvEvent, ...]:
        """The prefix cache's events since the last call, oldest first."""
        return self.scheduler.kv_manager.kv_events.take()

    def flush_prefix_cache(self) -> tuple[int, int]:
        """Drop the prefix cache; (blocks freed, blocks unpublished that running requests
        hold). A step in flight (asynchronous output) is unaffected: it owns its blocks."""
        return self.scheduler.kv_manager.flush()

    @property
    def request_limits(self) -> RequestLimits:
        """What a request must fit (stage 1 checks the same rules before admission)."""
        return self.scheduler.limits

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its blocks are free when this returns."""
        self._abort(request_id)
        self._drain_if_idle()

    def _abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.runner.forget(request_id)

    def step(self) -> list[RequestOutput]:
        """One step: schedule, run, update, emit. A request that made it fail is aborted
        and listed by ``take_failed``; the others get their outputs as if it had not been
        there. With asynchronous output these are the outputs of the step launched by the
        previous call."""
        start = time.perf_counter()
        outputs = self._resolve_history_readers()
        sched = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = self.runner.run(sched)
        outputs += self._update(sched, launched)
        self.last_step_timing = _timing(sched, launched, start, scheduled)
        self.scheduler.observe_step(sched, time.perf_counter() - start)
        return outputs

    def _resolve_history_readers(self) -> list[RequestOutput]:
        """The step in flight, resolved now if a sequence it samples for reads its history
        (penalties, a grammar): the next step cannot sample for it before its id is known."""
        if self._in_flight is None or not _reads_history(self._in_flight[0]):
            return []
        in_flight, self._in_flight = self._in_flight, None
        return self._resolve(*in_flight)

    def _update(self, sched: SchedulerOutput, launched: StepResult) -> list[RequestOutput]:
        """The launched step handed to the scheduler; its outputs (synchronous output), or
        the previous step's (asynchronous: this one stays in flight)."""
        outputs: list[RequestOutput] = []
        if self.async_output:  # the previous step's tokens first, then this one's fails
            previous, self._in_flight = self._in_flight, (sched, launched)
            if previous is not None:
                outputs = self._resolve(*previous)
        self._fail(launched.faulty)  # commit skips them
        self.scheduler.commit(sched)
        self._count_prompt_tokens(sched)
        if self.async_output:
            self._drain_if_idle()
        else:
            outputs = self._resolve(sched, launched)
        return outputs

    def take_failed(self) -> list[tuple[str, str]]:
        """(request_id, client message) of requests the engine failed since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _resolve(self, sched: SchedulerOutput, launched: StepResult) -> list[RequestOutput]:
        """Wait for a launched step's ids and hand them to the scheduler."""
        runner_out = launched.resolve()
        # Only requests still live as this step's sequences: one that finished meanwhile
        # may have been followed by a new request under the same id.
        live = {
            item.seq.request_id
            for item in sched.scheduled
            if self.scheduler.get(item.seq.request_id) is item.seq
        }
        self._fail({rid: m for rid, m in runner_out.faulty.items() if rid in live})
        outputs = self.scheduler.resolve(sched, runner_out)
        for out in outputs:
            self._generation_tokens += len(out.new_token_ids)
            if out.finished:
                self.runner.forget(out.request_id)
        return outputs

    def _fail(self, faulty: dict[str, str]) -> None:
        for request_id, message in faulty.items():
            if self.scheduler.get(request_id) is not None:
                self._abort(request_id)
                self._failed.append((request_id, message))

    def _drain_if_idle(self) -> None:
        """No request is left: wait for the step in flight, whose outputs are nobody's."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            _, launched = self._in_flight
            self._in_flight = None
            launched.resolve()

    def _count_prompt_tokens(self, sched: SchedulerOutput) -> None:
        for item in sched.scheduled:
            prompt_left = item.seq.num_prompt_tokens - (
                item.seq.num_computed_tokens - item.num_own_tokens
            )
            self._prompt_tokens += max(0, min(item.num_own_tokens, prompt_left))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.scheduler.kv_manager
        owned = live_tokens = prefill_pending = 0
        for seq in sched.live_sequences():
            owned += len(seq.block_ids)
            live_tokens += min(seq.num_computed_tokens, len(seq.block_ids) * self.block_size)
            if not seq.output_token_ids:
                prefill_pending += seq.num_prompt_tokens
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_swapped=sched.num_swapped,
            num_blocks=self.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            block_size=self.block_size,
            kv_usage=kv.usage,
            kv_slots_allocated=owned * self.block_size,
            kv_slots_used=live_tokens,
            num_preemptions=sched.num_preemptions,
            prefix_cache_hit_tokens=kv.prefix_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            spec_draft_tokens=sched.drafts.num_draft_tokens,
            spec_accepted_tokens=sched.drafts.num_accepted_tokens,
            spec_emitted_tokens=sched.drafts.num_spec_emitted_tokens,
            samples_forked=sched.num_forked,
            samples_not_forked=sched.num_fork_fallbacks,
            prefill_pending_tokens=prefill_pending,
        )

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
    ) -> list[CompletionOutput]:
        """Run prompts to completion with continuous batching; outputs in input order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("params: need one SamplingParams per prompt")
        results = {}
        order = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"gen-{next(self._ids)}"
            ids = self._encode(prompt)
            self.add_request(rid, ids, p)
            order.append(rid)
            results[rid] = _Accumulator(rid, ids)
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].add(out)
        return [results[rid].finish(self.tokenizer) for rid in order]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode_prompt(prompt)
        return list(prompt)


class _Accumulator:
    def __init__(self, request_id: str, prompt_ids: list[int]) -> None:
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob | None] = []
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.last = out

    def finish(self, tokenizer) -> CompletionOutput:
        last = self.last
        return CompletionOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.token_ids,
            text=tokenizer.decode(self.token_ids, skip_special_tokens=True) if tokenizer else None,
            finish_reason=last.finish_reason if last else FinishReason.ABORT,
            logprobs=self.logprobs,
            num_cached_tokens=last.num_cached_tokens if last else 0,
        )


def _reads_history(sched: SchedulerOutput) -> bool:
    """Does a sequence this step samples for also sample from its history (penalties, a
    grammar's matcher)? Its next step cannot sample until this step's token is known on
    the host."""
    return any(item.samples and item.seq.sampling_params.reads_history for item in sched.scheduled)


def _timing(
    sched: SchedulerOutput, launched: StepResult, start: float, scheduled: float
) -> StepTiming:
    """Plain numbers only (a few perf_counter reads per step); stage 3 turns them into
    metrics."""
    return StepTiming(
        schedule_s=scheduled - start,
        forward_s=launched.forward_end - scheduled,
        sample_s=time.perf_counter() - launched.forward_end,
        idle_s=0.0,
        num_seqs=len(sched.scheduled),
        num_tokens=sum(item.num_new_tokens for item in sched.scheduled),
        mask_s=launched.mask_seconds,
    )


def _async_output(config: EngineConfig, device: torch.device) -> bool:
    """Whether steps launch before the previous one's ids are read (auto: on CUDA), and
    never with speculative decoding (ValueError naming the option if both were asked)."""
    wanted = config.device.async_output
    if config.speculative.enabled:
        if wanted:
            raise ValueError(
                "async_output: speculative decoding needs synchronous output "
                "(--no-async-output, or --speculative-method none)"
            )
        return False
    return device.type == "cuda" if wanted is None else wanted


def _max_model_len(asked: int | None, model: ModelConfig) -> int:
    """--max-model-len, or the model's context: every attention path (CPU kernels, torch
    reference, CUDA kernels) masks the sliding window, so a windowed model gets it whole."""
    limit = model.max_position_embeddings
    return min(asked or limit, limit)
