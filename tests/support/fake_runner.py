"""A fake model runner for scheduler tests: a simulated paged KV cache, no model.

``FakeRunner.execute(SchedulerOutput) -> ModelRunnerOutput`` behaves like the
real runner where the scheduler can tell: it performs the swap and fork copies, writes
each scheduled token id into its KV slot through the block table, and
"samples" the next token as a hash of the whole context *read back from the
cache*. So a wrong block table, a prefix-cache hit on the wrong block, a lost
swap copy or a slot read before it was written changes the output (or raises),
and the same request yields the same tokens alone, batched, chunked,
preempted or served from the prefix cache. ``reference_tokens`` gives those
tokens without any cache, for comparison.

``launch`` is the asynchronous form (compute/engine.py's asynchronous output): it does
the step's work at once but hands back its sampled ids only through ``FakeStep.resolve``,
and an input that is still a PLACEHOLDER in the sequence is taken from the ids the
previous launch sampled, as the real runner reads them on the device. A placeholder fed
to the wrong slot, or one never filled, changes the tokens or raises.
"""

from __future__ import annotations

import hashlib
from array import array

from compute.core.messages import TokenLogprob
from compute.core.outputs import ModelRunnerOutput, SchedulerOutput
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import PLACEHOLDER

_EMPTY = -1  # a slot nobody wrote


def fake_token(
    context: list[int], vocab_size: int, eos_token_id: int | None, eos_rate: float
) -> int:
    """The deterministic "model": the next token as a function of the whole context."""
    digest = hashlib.blake2b(array("q", context).tobytes(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    if eos_token_id is not None and (value >> 40) % 10_000 < eos_rate * 10_000:
        return eos_token_id
    token = value % vocab_size
    return token + 1 if token == eos_token_id else token


class FakeRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        eos_rate: float = 0.0,
        eos_after: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_rate = eos_rate  # chance per sampled token of emitting eos_token_id
        self.eos_after = eos_after  # if set: every request emits EOS after this many tokens
        self.device = [[_EMPTY] * block_size for _ in range(num_blocks)]
        self.host = [[_EMPTY] * block_size for _ in range(num_host_blocks)]
        self.num_steps = 0
        self._step_ids: dict[str, int] = {}  # what the latest launch sampled, per request
        self._prev_ids: dict[str, int] = {}
        self.num_placeholders_fed = 0  # inputs taken from the previous launch's ids
        self.num_computed_tokens = 0  # cumulative tokens written (for prefix-cache tests)
        self.num_draft_tokens = 0  # cumulative speculative draft tokens scored

    def token_for(self, context: list[int], num_output_tokens: int = 0) -> int:
        """The token the fake model samples after ``context`` (its outputs so far counted)."""
        if self.eos_token_id is not None and num_output_tokens == self.eos_after:
            return self.eos_token_id
        return fake_token(context, self.vocab_size, self.eos_token_id, self.eos_rate)

    def launch(self, sched: SchedulerOutput) -> FakeStep:
        """``execute`` whose ids the scheduler learns only from ``resolve``."""
        self._prev_ids, self._step_ids = self._step_ids, {}
        out = self.execute(sched)
        self._step_ids = dict(zip(out.request_ids, out.sampled_token_ids, strict=True))
        return FakeStep(out)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Same order as the real runner: copies first, then the forward pass.
        for device_block, host_block in sched.blocks_to_swap_out:
            self.host[host_block] = list(self.device[device_block])
        for host_block, device_block in sched.blocks_to_swap_in:
            self.device[device_block] = list(self.host[host_block])
        for src, dst in sched.blocks_to_copy:  # forks, after the swaps
            self.device[dst] = list(self.device[src])
        for item in sched.scheduled:
            self._write(
                item.seq, item.seq.num_computed_tokens, item.num_own_tokens, item.draft_token_ids
            )
        out = ModelRunnerOutput(request_ids=[], sampled_token_ids=[], logprobs=[])
        for item in sched.scheduled:
            if item.samples:
                end = item.seq.num_computed_tokens + item.num_own_tokens
                emitted = self._verify(item.seq, end, item.draft_token_ids)
                token = emitted[0]
                out.request_ids.append(item.seq.request_id)
                out.sampled_token_ids.append(token)
                out.logprobs.append(TokenLogprob(token, -1.0) if _wants(item.seq) else None)
                if item.draft_token_ids:
                    out.more_tokens[item.seq.request_id] = [
                        (t, TokenLogprob(t, -1.0) if _wants(item.seq) else None)
                        for t in emitted[1:]
                    ]
        self.num_steps += 1
        return out

    def _verify(self, seq, end: int, draft: tuple[int, ...]) -> list[int]:
        """Greedy verification: the token after each position from ``end - 1`` on, while
        the draft agrees, read back from the cache (so draft slots must be written)."""
        emitted: list[int] = []
        for i in range(len(draft) + 1):
            token = self.token_for(self._read(seq, end + i), seq.num_output_tokens + i)
            emitted.append(token)
            if i == len(draft) or token != draft[i]:
                break
        self.num_draft_tokens += len(draft)
        return emitted

    def _write(self, seq, start: int, count: int, draft: tuple[int, ...] = ()) -> None:
        tokens = seq.token_ids_slice(start, start + count)
        if tokens and tokens[-1] == PLACEHOLDER:  # sampled by the previous launch
            tokens[-1] = self._prev_ids[seq.request_id]
            self.num_placeholders_fed += 1
        if PLACEHOLDER in tokens:
            raise RuntimeError(f"{seq.request_id}: a placeholder that no launch sampled")
        tokens += draft
        count += len(draft)
        for pos, token in zip(range(start, start + count), tokens, strict=True):
            block, offset = self._slot(seq, pos)
            self.device[block][offset] = token
        self.num_computed_tokens += count

    def _read(self, seq, end: int) -> list[int]:
        context = []
        for pos in range(end):
            block, offset = self._slot(seq, pos)
            token = self.device[block][offset]
            if token == _EMPTY:
                raise RuntimeError(f"{seq.request_id}: position {pos} read before written")
            context.append(token)
        return context

    def _slot(self, seq, pos: int) -> tuple[int, int]:
        index = pos // self.block_size
        if index >= len(seq.block_ids):
            raise RuntimeError(f"{seq.request_id}: position {pos} beyond its block table")
        return seq.block_ids[index], pos % self.block_size


class FakeStep:
    """A launched fake step: its output, once the engine asks for it."""

    def __init__(self, out: ModelRunnerOutput) -> None:
        self._out = out

    def resolve(self) -> ModelRunnerOutput:
        return self._out


def reference_tokens(
    prompt: list[int],
    params: SamplingParams,
    runner: FakeRunner,
    eos_token_ids: tuple[int, ...] = (),
) -> list[int]:
    """What the fake model generates for ``prompt`` with no cache, batching or preemption."""
    context, out = list(prompt), []
    while len(out) < params.max_tokens:
        token = runner.token_for(context, len(out))
        out.append(token)
        context.append(token)
        if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
            break
    return out


def _wants(seq) -> bool:
    return seq.sampling_params.wants_logprobs
