"""The serving pipeline's facade: what the gRPC servicer calls.

It wires the three stages (PPL.LLM style) around one engine:

    generate() --tokenize pool (stage 1)--> AddRequest --> step loop (stage 2, owns the
    engine) --> StepOutputs --> output pool (stage 3: detokenize, stop strings)
    --> the request's asyncio queue --> generate() yields Chunk..., Complete

Admission is bounded (``max_pending``), so overload answers RESOURCE_EXHAUSTED instead
of growing queues. A consumer that stops early (aclose, cancellation) sends an
``Abort`` to stage 2, which frees the request's KV blocks at its next step.

Beside the stages, ``kv_events`` (services/pipeline/kv_event_hub.py) takes what stage 2
reports of its prefix cache after every turn (stored and evicted blocks, stats) for the
worker protocol's KV-event streams, and ``flush_cache`` drops that cache through stage 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from compute.core.errors import FieldError
from compute.core.messages import (
    Abort,
    AddRequest,
    CacheFlushed,
    EngineStats,
    FlushPrefixCache,
    Shutdown,
)
from compute.sampling.grammar_compiler import GrammarCompiler
from compute.step_loop import Inbound, StepLoop, run_step_loop
from kernels.log import get_logger
from services.domain import (
    ChatMessage,
    Chunk,
    Complete,
    GenerateInput,
    ModelInfo,
    RequestError,
    ResourceExhausted,
    Unavailable,
)
from services.pipeline.engine_load import EngineShape
from services.pipeline.grammar_compile import GrammarConfig, GrammarStage
from services.pipeline.kv_event_hub import KvEventHub
from services.pipeline.output_stage import OutputStage
from services.pipeline.request_state import RequestStream
from services.pipeline.samples import Prepare, check_samples, generate_samples
from services.pipeline.tokenize_stage import TokenizeStage
from services.telemetry.metrics import NO_METRICS, Metrics

if TYPE_CHECKING:  # the engine module pulls in torch and the model
    from compute.engine import Engine
    from compute.tokenizer.tokenizer import Tokenizer

log = get_logger(__name__)


_GRAMMAR_FIELDS = ("grammar_workers", "grammar_timeout_s", "grammar_cache_size")


@dataclass(frozen=True)
class PipelineConfig:
    max_pending: int = 256  # requests admitted and not finished; beyond -> RESOURCE_EXHAUSTED
    tokenize_workers: int = 2  # stage-1 threads
    output_workers: int = 1  # stage-3 threads (requests are sharded, so each stays ordered)
    max_n: int = 16  # most samples (n) one request may ask for; each counts in max_pending
    # Constraint compilation (services/pipeline/grammar_compile.py): threads, time limit, cache.
    grammar_workers: int = 1
    grammar_timeout_s: float = 5.0
    grammar_cache_size: int = 256

    def __post_init__(self) -> None:
        for name in (
            "max_pending",
            "tokenize_workers",
            "output_workers",
            "max_n",
        ) + _GRAMMAR_FIELDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def grammar(self) -> GrammarConfig:
        return GrammarConfig(self.grammar_workers, self.grammar_timeout_s, self.grammar_cache_size)


class Admission:
    """Counts requests admitted and not finished, and how long that count was non-zero."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._count = 0
        self._since: float | None = None  # when the count last left zero
        self._active_total = 0.0  # seconds with a non-zero count, closed intervals only

    def try_acquire(self) -> bool:
        with self._lock:
            if self._count >= self._limit:
                return False
            if self._count == 0:
                self._since = time.monotonic()
            self._count += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._since is not None:
                self._active_total += time.monotonic() - self._since
                self._since = None

    @property
    def count(self) -> int:
        return self._count

    @property
    def limit(self) -> int:
        return self._limit

    def active_since(self) -> float | None:
        return self._since

    def active_seconds(self) -> float:
        with self._lock:
            ongoing = time.monotonic() - self._since if self._since is not None else 0.0
            return self._active_total + ongoing


class Pipeline:
    """Three stages around one engine; ``generate`` streams one request's events."""

    def __init__(
        self,
        engine: Engine,
        config: PipelineConfig = PipelineConfig(),
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._admission = Admission(config.max_pending)
        self._max_n = config.max_n
        self._inbox: queue.Queue[Inbound] = queue.Queue()
        self._stage1 = TokenizeStage(
            engine.tokenizer, engine.request_limits, config.tokenize_workers
        )
        self._grammars = GrammarStage(_grammar_compiler(engine), config.grammar, metrics)
        self._stage3 = OutputStage(engine.tokenizer, self._abort, metrics, config.output_workers)
        self.kv_events = KvEventHub(
            _shape(engine),
            engine.stats(),
            lambda: self._admission.count,
            self._admission.active_since,
            metrics,
        )
        self._stage2 = StepLoop(
            engine,
            self._inbox,
            self._stage3.submit,
            self._admission.active_since,
            self.kv_events.publish,
        )
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._state = "new"  # -> "running" -> "stopped"
        metrics.bind_step_loop_idle_ratio(self.step_loop_idle_fraction)

    def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"pipeline is {self._state}; start() it once")
        self._threads = [run_step_loop(self._stage2), *self._stage3.start()]
        self._state = "running"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the stages; requests still in flight end with Unavailable."""
        if self._state != "running":
            self._state = "stopped"
            return
        self._state = "stopped"
        deadline = time.monotonic() + timeout
        self._inbox.put(Shutdown())
        self._threads[0].join(max(0.0, deadline - time.monotonic()))
        self._stage3.request_stop()
        for thread in self._threads[1:]:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("pipeline threads did not stop in time", threads=alive)
        self._stage3.fail_remaining("the server is shutting down")
        self._stage1.shutdown()
        self._grammars.shutdown()

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Chunk | Complete]:
        """Chunk(s) then exactly one Complete per sample (``inp.n``, each event with its
        sample_index: services/pipeline/samples.py); RequestError subclasses for failures."""
        try:
            check_samples(inp, self._max_n)
        except FieldError:
            self._reject("invalid_argument")
            raise
        prepare = partial(self._prepare, inp)
        one = partial(self._generate_one, inp.request_id)
        events = one(prepare) if inp.n == 1 else generate_samples(inp, prepare, one)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _generate_one(
        self, base_id: str, prepare: Prepare
    ) -> AsyncIterator[Chunk | Complete]:
        """One engine request's events; ``prepare(request_id, arrival)`` builds it."""
        arrival = time.monotonic()
        self._admit()
        request_id = f"{base_id}#{next(self._ids)}"
        stream: RequestStream | None = None
        ended = False
        try:
            req = await prepare(request_id, arrival)
            stream = self._submit(req)
            while not ended:
                event = await stream.get()
                if isinstance(event, RequestError):
                    ended = True
                    raise event
                ended = isinstance(event, Complete)
                yield event
        finally:
            if stream is not None and not ended:
                self._cancel(request_id)
            self._admission.release()

    async def tokenize(
        self,
        prompt: str | None,
        chat: tuple[ChatMessage, ...] | None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], list[str]]:
        if self._state == "stopped":
            raise Unavailable("the server is shutting down")
        return await self._stage1.tokenize(prompt, chat, add_generation_prompt)

    def model_info(self) -> ModelInfo:
        engine, model = self._engine, self._engine.model_config
        return ModelInfo(
            model_name=model.name,
            architecture=model.architecture,
            max_model_len=engine.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=tuple(model.eos_token_ids),
            dtype=str(engine.dtype).removeprefix("torch."),
            device=str(engine.device),
            block_size=engine.block_size,
            kv_cache_capacity_tokens=engine.request_limits.kv_capacity_tokens,
            kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
            weights=engine.weights,
            cuda_graph_batch_sizes=engine.cuda_graph_batch_sizes,
            async_output=engine.async_output,
            **self._grammars.info(),
            rope_type=model.rope_type,
            sliding_window=model.sliding_window or 0,
            sliding_window_layers=model.sliding_layers,
            num_layers=model.num_layers,
            attn_logit_softcapping=model.attn_logit_softcap or 0.0,
            final_logit_softcapping=model.final_logit_softcap or 0.0,
            features=model.features(),
        )

    def engine_stats(self) -> EngineStats:
        return self._stage2.stats

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (None for dummy weights), as gateways must load it."""
        return self._engine.tokenizer

    async def flush_cache(self, timeout: float) -> CacheFlushed:
        """Drop the prefix cache (through stage 2, between two steps); TimeoutError when
        stage 2 does not answer within ``timeout`` seconds (a wedged engine)."""
        if not self.healthy:
            raise Unavailable("the server is not serving")

        def submit(flush_id: int) -> None:
            self._inbox.put(FlushPrefixCache(flush_id))

        return await self.kv_events.flush(submit, timeout)

    @property
    def healthy(self) -> bool:
        """Running, with a live step loop and output workers (False once one died: the
        server then stops)."""
        return self._state == "running" and not (self._stage2.crashed or self._stage3.crashed)

    @property
    def num_pending(self) -> int:
        return self._admission.count

    def step_loop_idle_fraction(self) -> float:
        active = self._admission.active_seconds()
        return min(1.0, self._stage2.idle_seconds / active) if active > 0 else 0.0

    # -- generate's steps -------------------------------------------------------------

    def _admit(self) -> None:
        if not self.healthy:
            self._reject("unavailable")
            raise Unavailable("the server is not accepting requests")
        if not self._admission.try_acquire():
            self._reject("resource_exhausted")
            raise ResourceExhausted(
                f"too many requests in flight (max_pending={self._admission.limit})"
            )

    async def _prepare(self, inp: GenerateInput, request_id: str, arrival: float) -> AddRequest:
        """Stage 1: the tokenized, checked request."""
        try:
            req = await self._stage1.prepare(inp, request_id, arrival)
            if inp.constraint is None:
                return req
            grammar = await self._grammars.compile(inp.constraint)
            params = replace(req.params, grammar=grammar)  # FieldError: ignore_eos
            self._metrics.observe_constrained(inp.constraint.kind)
            return replace(req, params=params)
        except FieldError:
            self._reject("invalid_argument")
            raise
        except RuntimeError as exc:
            if self._state == "stopped":  # the pool was shut down under us
                raise Unavailable("the server is shutting down") from exc
            raise

    def _submit(self, req: AddRequest) -> RequestStream:
        """Register with stage 3 first, so stage 2's first output always finds the stream."""
        if not self.healthy:  # a stage died while this request was tokenized: nothing would answer
            self._reject("unavailable")
            raise Unavailable("the server is not accepting requests")
        stream = RequestStream(asyncio.get_running_loop())
        self.kv_events.attach(stream.loop)  # before the request's first cache event
        self._stage3.register(req, stream)
        self._inbox.put(req)
        return stream

    def _cancel(self, request_id: str) -> None:
        if not self._stage3.release(request_id):
            return  # it had ended already (its last event was left unread)
        self._inbox.put(Abort(request_id, "cancelled"))
        self._metrics.observe_finished("abort")
        log.info("request cancelled", request_id=request_id)

    def _abort(self, request_id: str) -> None:
        """Stage 3's way back to stage 2 (a stop string ended the request)."""
        self._inbox.put(Abort(request_id, "stop_string"))

    def _reject(self, reason: str) -> None:
        self._metrics.observe_rejected(reason)


def _shape(engine: Engine) -> EngineShape:
    """The engine's limits and memory, as load records report them."""
    memory = getattr(engine, "memory", None) or {}  # compute/device/memory_report.py
    weights, kv = memory.get("model_bytes"), memory.get("kv_cache_bytes")
    return EngineShape(
        max_running=engine.max_num_seqs,
        token_capacity=engine.num_blocks * engine.block_size,
        weight_bytes=sum(weights.values()) if weights else None,
        kv_cache_bytes=sum(kv.values()) if kv else None,
    )


def _grammar_compiler(engine: Engine) -> GrammarCompiler | None:
    """The engine's vocabulary for grammars (None without a tokenizer: dummy weights)."""
    if engine.tokenizer is None:
        return None
    return GrammarCompiler.for_tokenizer(engine.tokenizer, engine.model_config.vocab_size)
