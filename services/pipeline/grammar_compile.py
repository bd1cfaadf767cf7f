"""Stage 1's grammar compilation: constraints compiled on a pool of their own, in time.

A request with a constraint (``GenerateInput.constraint``) has it compiled here after its
prompt is tokenized, on threads that neither the tokenizer nor the step loop waits for.
A compile that takes longer than ``timeout_s`` fails its request with INVALID_ARGUMENT
naming the field; it still runs to its end in the background (llguidance's limits bound
it) and its result is cached, so the same text asked again waits for the same compile
instead of starting another. Compiled grammars are cached by their text (``Constraint.key``,
least recently used out beyond ``cache_size``); a constraint that failed to compile is
cached as the failure, so a client resending a bad schema costs nothing more.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version

from compute.core.errors import FieldError
from compute.core.grammar import KINDS, MAX_CONSTRAINT_CHARS, CompiledGrammar, Constraint
from compute.sampling.grammar_compiler import GrammarCompiler
from services.telemetry.metrics import NO_METRICS, Metrics

SUPPORTED_KINDS = KINDS


@dataclass(frozen=True)
class GrammarConfig:
    workers: int = 1  # compile threads (beside the tokenize pool)
    timeout_s: float = 5.0  # a constraint not compiled by then fails its request
    cache_size: int = 256  # compiled constraints kept, by their text

    def __post_init__(self) -> None:
        if self.workers < 1 or self.cache_size < 1 or not self.timeout_s > 0:
            raise ValueError("grammar: workers, cache_size and timeout_s must be positive")


class GrammarStage:
    """Compiles constraints off the event loop and the step loop, cached and time-limited."""

    def __init__(
        self,
        compiler: GrammarCompiler | None,
        config: GrammarConfig = GrammarConfig(),
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._compiler = compiler
        self._config = config
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="headrace-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        if compiler is not None:  # the tokenizer's one-off preparation, before any request
            self._pool.submit(compiler.warm_up)

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled constraint; FieldError naming ``constraint.field`` when it is invalid,
        unsupported or too slow to compile."""
        if self._compiler is None:
            raise FieldError(constraint.field, "constraints need a model with a tokenizer")
        future = self._future(constraint)
        try:
            wrapped = asyncio.shield(asyncio.wrap_future(future))
            return await asyncio.wait_for(wrapped, self._config.timeout_s)
        except TimeoutError:
            self._metrics.observe_grammar_compile("timeout", self._config.timeout_s)
            raise FieldError(
                constraint.field, f"did not compile within {self._config.timeout_s:g} s"
            ) from None
        except FieldError as exc:  # cached by text: name this request's field
            raise exc.at(constraint.field) from None

    def info(self) -> dict:
        """What ModelInfo says of constraints (services/domain.py)."""
        if self._compiler is None:
            return {}
        return {
            "constraint_kinds": SUPPORTED_KINDS,
            "grammar_library": f"llguidance {version('llguidance')}",
            "grammar_compile_timeout_seconds": self._config.timeout_s,
            "grammar_cache_size": self._config.cache_size,
            "max_constraint_chars": MAX_CONSTRAINT_CHARS,
        }

    def cache_len(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _future(self, constraint: Constraint) -> Future[CompiledGrammar]:
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._metrics.observe_grammar_compile("cached", 0.0)
                return future
            future = self._pool.submit(self._timed_compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self._config.cache_size:
                self._cache.popitem(last=False)
        return future

    def _timed_compile(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        outcome = "error"
        try:
            compiled = self._compiler.compile(constraint)
            outcome = "compiled"
            return compiled
        except FieldError:
            outcome = "invalid"
            raise
        except Exception:
            with self._lock:  # not the constraint's fault: never cached
                self._cache.pop(constraint.key, None)
            raise
        finally:
            self._metrics.observe_grammar_compile(outcome, time.perf_counter() - start)
