"""A stand-in for ``compute.engine.Engine`` with the same step-wise API and no model.

Every request generates the same scripted token sequence (cycled), one token per
step, at most ``max_num_seqs`` at a time in arrival order. Tests steer it with a few
knobs (a step delay, a prompt token that makes ``step`` raise, prompts that
``add_request`` refuses) and read what happened (``added``, ``aborted``).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

import torch

from compute.core.checks import RequestLimits
from compute.core.config import ModelConfig
from compute.core.errors import FieldError
from compute.core.messages import (
    EngineStats,
    FinishReason,
    RequestOutput,
    StepTiming,
    TokenLogprob,
)
from compute.core.sampling_params import SamplingParams
from compute.engine import CompletionOutput
from compute.tokenizer.tokenizer import Tokenizer


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """The real tokenizer of the embedded default model (loaded once per test session)."""
    from compute.loaders.default_model import default_model_path

    return Tokenizer.from_gguf(default_model_path())


@dataclass
class _FakeSeq:
    prompt: list[int]
    params: SamplingParams
    num_output: int = 0


class FakeEngine:
    """Deterministic engine: request i's k-th token is ``script[k % len(script)]``."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        script: list[int] | None = None,
        *,
        vocab_size: int | None = None,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        step_delay: float = 0.0,
        poison_token: int | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = list(script or [42])
        vocab = vocab_size or (tokenizer.vocab_size if tokenizer else 1000)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer else (0,)
        self.model_config = ModelConfig(
            name="fake", architecture="llama", vocab_size=vocab, hidden_size=8,
            intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
            eos_token_ids=tuple(eos_token_ids),
        )  # fmt: skip
        self.max_model_len = max_model_len
        self.block_size = 16
        self.num_blocks = 1024
        self.request_limits = RequestLimits(max_model_len, self.num_blocks, self.block_size, vocab)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_dtype = torch.float32
        self.weights = "dense"
        self.cuda_graph_batch_sizes: tuple[int, ...] = ()
        self.async_output = False
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.poison_token = poison_token  # a running prompt holding it makes step() raise
        self.refuse_token: int | None = None  # a prompt holding it: add_request FieldError
        self.added: list[str] = []
        self.params: dict[str, SamplingParams] = {}  # every request's, as it reached the engine
        self.forks: dict[str, str | None] = {}  # every request's fork_of
        self.salts: dict[str, str | None] = {}  # every request's cache_salt
        self.flushes = 0  # flush_prefix_cache calls (it has no cache: nothing to drop)
        self.aborted: list[str] = []
        self.num_steps = 0
        self.last_step_timing: StepTiming | None = None
        self._seqs: dict[str, _FakeSeq] = {}
        self._lock = threading.Lock()  # tests read while the step loop writes
        self._generation_tokens = 0

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
        if self.refuse_token is not None and self.refuse_token in prompt_token_ids:
            raise FieldError("prompt", "the fake engine refuses this prompt")
        with self._lock:
            self._seqs[request_id] = _FakeSeq(list(prompt_token_ids), params)
            self.added.append(request_id)
            self.params[request_id] = params
            self.forks[request_id] = fork_of
            self.salts[request_id] = cache_salt

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._seqs.pop(request_id, None)
            self.aborted.append(request_id)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        with self._lock:
            running = list(self._seqs.items())[: self.max_num_seqs]
            if self.poison_token is not None and any(
                self.poison_token in seq.prompt for _, seq in running
            ):
                raise RuntimeError("fake engine: poisoned batch")
            outs = [self._advance(rid, seq) for rid, seq in running]
            n = len(running)  # one token per sequence; the sleep stands in for the forward
            self.last_step_timing = StepTiming(0.0, self.step_delay, 0.0, 0.0, n, n)
            for out in outs:
                if out.finished:
                    del self._seqs[out.request_id]
        return outs

    def _advance(self, request_id: str, seq: _FakeSeq) -> RequestOutput:
        token = self.script[seq.num_output % len(self.script)]
        seq.num_output += 1
        self._generation_tokens += 1
        params = seq.params
        reason, stop_id = None, None
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        if token in eos or token in params.stop_token_ids:
            reason, stop_id = FinishReason.STOP, token
        elif seq.num_output >= params.max_tokens:
            reason = FinishReason.LENGTH
        lp = TokenLogprob(token, -0.25, ((token, -0.25),) * params.top_logprobs)
        return RequestOutput(
            request_id=request_id,
            new_token_ids=(token,),
            new_logprobs=(lp if params.wants_logprobs else None,),
            finished=reason is not None,
            finish_reason=reason,
            stop_token_id=stop_id,
            num_prompt_tokens=len(seq.prompt),
            num_cached_tokens=0,
            num_output_tokens=seq.num_output,
        )

    def record_kv_events(self, on: bool = True) -> None:
        """No prefix cache, so no KV events (the real engine's are tested on dummy weights)."""

    def take_kv_events(self) -> tuple:
        return ()

    def flush_prefix_cache(self) -> tuple[int, int]:
        self.flushes += 1
        return 0, 0

    def take_failed(self) -> list[tuple[str, str]]:
        return []  # the fake fails whole steps (poison_token), never one request

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._seqs)

    def stats(self) -> EngineStats:
        with self._lock:
            running = min(len(self._seqs), self.max_num_seqs)
            waiting = len(self._seqs) - running
        return EngineStats(
            num_running=running, num_waiting=waiting, num_swapped=0,
            num_blocks=self.num_blocks, num_free_blocks=self.num_blocks - running,
            block_size=self.block_size, kv_usage=running / self.num_blocks,
            kv_slots_allocated=running * self.block_size, kv_slots_used=running,
            num_preemptions=0, prefix_cache_hit_tokens=0, prompt_tokens=0,
            generation_tokens=self._generation_tokens,
        )  # fmt: skip

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[CompletionOutput]:
        """The offline API, for completeness: run everything to the end."""
        for i, prompt in enumerate(prompts):
            self.add_request(f"offline-{i}", list(prompt), params)
        tokens: dict[str, list[int]] = {f"offline-{i}": [] for i in range(len(prompts))}
        reasons: dict[str, FinishReason] = {}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [
            CompletionOutput(rid, list(p), tokens[rid], None, reasons[rid], [], 0)
            for rid, p in zip(tokens, prompts, strict=True)
        ]
