"""Iteration-level scheduler: re-forms the batch at every step (continuous batching).

Every live request is "num_computed_tokens catching up to num_tokens", so
prefill, chunked prefill and decode are one thing and a step mixes them
(Sarathi-Serve). Per step there is one token budget (max_num_batched_tokens)
and a cap on running sequences (max_num_seqs). Order of service:

1. running decodes, oldest (or highest-priority) first;
2. running sequences still mid-prefill continue with their next chunk;
3. swapped-out sequences come back (preemption_mode="swap");
4. waiting requests, from the head of the queue, fill what is left of the
   budget with prefill chunks (prefix-cache hits are not recomputed, and a fork
   computes only its prompt's last token: see below).

Items 3 and 4 are skipped in a step that had to preempt: the blocks just
freed are for the running sequences (and a step never both swaps out and
swaps in, so the runner may do the two copy lists in either order, as long as
it does them before the forward pass). When a running sequence cannot get a
block, the newest running sequence (under "priority": the lowest-priority,
newest) is preempted, possibly itself: recompute frees its blocks and puts it
back in the waiting queue ahead of newer requests; swap copies its blocks to
host memory (falling back to recompute when host blocks run out). Admission
rejects any request that could never fit the whole cache, so a lone request
always makes progress, and the first running request in policy order is
never a victim while another runs: no deadlock, no starvation.

``prefill_interval`` = N > 0: after N consecutive steps that ran prefill work
(new admissions or running prefill chunks) alongside decodes, the next step
is decode-only (no prefill chunks, no admissions, no swap-ins). A step with
prefill tokens is slower, and every decode in it waits for them; the
decode-only step bounds how long decodes run at that slower pace (their
inter-token latency) under a steady stream of arrivals, at the cost of time
to first token. 0 disables it.

Forks (n > 1, services/pipeline/samples.py): a request naming ``fork_of`` is admitted,
while the sequence it names runs with the same prompt computed, with that prompt's K/V
instead of computing it: the full blocks shared by reference, a copy of the partial last
block (``blocks_to_copy``, done by the runner after the swaps and before the forward), and
``num_computed_tokens`` = prompt length - 1, so it computes only the last prompt token to
sample its first token from its own logits. Both sequences write only past the shared
blocks, so no shared block is ever written. A parent that is gone (finished, aborted,
preempted) or still computing its prompt is never waited for: the request is admitted as
any other (prefix-cache hits, or recomputation). After a preemption a fork is a sequence
like any other; its shared blocks are references the allocator counts, freed by the last.

Asynchronous output (compute/engine.py): the engine may schedule step N+1 before step
N's sampled ids reach the host. ``commit`` (once a step is launched) advances the step's
sequences and appends a PLACEHOLDER for each token it samples; ``resolve`` (when the ids
arrive, in launch order) puts the ids in their place, then stops, finishes and reports
as usual.
A sequence whose pending token already ends it by length is not scheduled again; one
that an id ends (EOS, a stop token) may have run one step too many, whose token is
dropped. A placeholder is never hashed into the prefix cache, and a sequence preempted
with one pending is not readmitted until it resolves. ``update_from_output`` is the two
at once (synchronous output).

Speculative decoding (``SpeculativeConfig``, synchronous output only): a decoding
sequence may get a draft, tokens guessed to follow it, scored in the same step after its
last token: 1 + K query tokens, counted against the budget, with KV slots reserved for all
of them, and never at the cost of a preemption (a draft that does not fit is dropped).
Which sequence gets one, and how drafting backs off after misses, is the draft policy's
(compute/core/drafts.py). Drafting changes only speed, never the tokens.

``resolve`` then takes the 1 + a tokens the runner emits (a accepted draft tokens, then
the model's own), one ``RequestOutput`` each, so a stop or a length limit inside the run
ends the request exactly there; ``num_computed_tokens`` counts only
the accepted inputs, and the tail blocks past the sequence are given back. Rejected
tokens' K/V lie past ``num_computed_tokens``, in blocks not yet full, which are never
published to the prefix cache before later steps overwrite those slots.

Pure Python, no torch: tested by feeding fake runner outputs.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable

from compute.core.checks import RequestLimits, check_request
from compute.core.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from compute.core.drafts import DraftPolicy
from compute.core.errors import FieldError
from compute.core.kv_cache_manager import KVCacheManager
from compute.core.messages import FinishReason, RequestOutput, TokenLogprob
from compute.core.outputs import ModelRunnerOutput, SchedulerOutput
from compute.core.sequence import PLACEHOLDER, Sequence, SequenceStatus
from compute.core.step_cost import StepCost
from compute.core.step_plan import StepPlan


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        num_host_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = scheduler_config
        self.drafts = DraftPolicy(speculative or SpeculativeConfig(), max_model_len)
        self.limits = RequestLimits(max_model_len, num_blocks, cache_config.block_size, vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.kv_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, num_host_blocks
        )
        self._watermark = scheduler_config.watermark(num_blocks)
        self.step_cost = StepCost()
        # Each queue is kept sorted by _order: arrival (fcfs) or (priority, arrival).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self._order: dict[str, tuple] = {}
        self._arrivals = itertools.count()
        self._prefill_streak = 0  # consecutive steps that mixed prefill work into decodes
        self.num_preemptions = 0  # cumulative
        # n > 1, cumulative: samples (requests naming fork_of) admitted by forking their
        # parent's prompt blocks, and those admitted as any other request instead.
        self.num_forked = 0
        self.num_fork_fallbacks = 0

    # -- queries ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def live_sequences(self) -> list[Sequence]:
        return self.running + self.swapped + self.waiting

    # -- admission and abort ------------------------------------------------

    def add_request(self, seq: Sequence) -> None:
        """Queue ``seq``; FieldError naming the field if it could never be served."""
        if seq.request_id in self._requests:
            raise FieldError("request_id", f"{seq.request_id!r} is already in flight")
        seq.sampling_params = check_request(seq.prompt_token_ids, seq.sampling_params, self.limits)
        seq.status = SequenceStatus.WAITING
        self._requests[seq.request_id] = seq
        arrival = (seq.arrival_time, next(self._arrivals))
        prio = (seq.priority,) if self.config.policy == "priority" else ()
        self._order[seq.request_id] = prio + arrival
        self._insert(self.waiting, seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks now; False if unknown."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._retire(seq, FinishReason.ABORT)
        return True

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        # Wherever it is: a token resolved late may finish a sequence preempted meanwhile.
        queue = {
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
        }[seq.status]
        _remove(queue, seq)
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._requests[seq.request_id]
        del self._order[seq.request_id]

    # -- scheduling ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = StepPlan(self.config.max_num_batched_tokens)
        decode_only = self._decode_only_turn()
        if not decode_only:
            self._schedule_oldest_prefill(step)
        self._schedule_running(step, decodes=True)
        if not decode_only:
            self._schedule_running(step, decodes=False)
            if not step.preempted:
                self._schedule_swapped(step)
                if not self.swapped:  # swapped sequences come back before new work
                    self._schedule_waiting(step)
        self._prefill_streak = self._prefill_streak + 1 if step.mixes_prefill_and_decode else 0
        return step.output()

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """How long a scheduled step took: the step-time fit (compute/core/step_cost.py)."""
        if self.config.max_step_ms is not None and sched.scheduled:
            self.step_cost.observe(sched.num_batched_tokens, sched.num_pairs, seconds)

    def _decode_only_turn(self) -> bool:
        interval = self.config.prefill_interval
        if interval == 0 or self._prefill_streak < interval:
            return False
        return any(_is_decode(seq) for seq in self.running)

    def _schedules(self, seq: Sequence, step: StepPlan, decodes: bool) -> bool:
        """Whether ``seq`` is a running sequence of that kind this pass may schedule."""
        if seq.status is not SequenceStatus.RUNNING or seq.request_id in step.scheduled:
            return False  # preempted earlier in this step, or already served
        return _is_decode(seq) == decodes and not self._ends_when_resolved(seq)

    def _schedule_oldest_prefill(self, step: StepPlan) -> None:
        """The oldest running sequence, when it is computing its prompt, goes first: its
        chunk may take every free block, and preempt newer sequences (none is scheduled
        yet) to make room for at least one block's worth. The budget the running decodes
        will take is left to them."""
        if not self.running or not self._schedules(self.running[0], step, decodes=False):
            return
        seq = self.running[0]
        decodes, decode_pairs = self._pending_decodes(exclude=seq)
        budget = step.budget - decodes
        most = self._chunk(seq, step, min(seq.num_tokens - seq.num_computed_tokens, budget),
                           extra=(decodes, decode_pairs))  # fmt: skip
        if most <= 0:
            return
        n = min(most, self.kv_manager.room_for(seq))
        if n < min(most, self.kv_manager.block_size):
            n = min(most, self.kv_manager.block_size)
            if not self._allocate_or_preempt(seq, n, step):
                return
            step.add(seq, n, False)
            return
        if self.kv_manager.allocate_slots(seq, n):
            step.add(seq, n, False)

    def _schedule_running(self, step: StepPlan, decodes: bool) -> None:
        """Running decodes (``decodes``), or running prompts' next chunks, oldest first.
        Only the oldest running sequence may preempt to grow (``_allocate_or_preempt``);
        another decode that finds no block waits for a step, and another prompt's chunk
        takes only the free blocks above the watermark."""
        oldest = self.running[0] if self.running else None
        for seq in list(self.running):
            if not self._schedules(seq, step, decodes):
                continue
            if step.budget <= 0:
                return
            if decodes:
                self._schedule_decode(seq, step, may_preempt=seq is oldest)
                continue
            n = self._chunk(seq, step, min(seq.num_tokens - seq.num_computed_tokens, step.budget))
            n = min(n, self.kv_manager.room_for(seq, self._watermark))
            if n > 0 and self.kv_manager.allocate_slots(seq, n):
                step.add(seq, n, False)

    def _schedule_decode(self, seq: Sequence, step: StepPlan, may_preempt: bool) -> None:
        draft = self.drafts.propose(seq, step.budget, len(self.running))
        n = 1 + len(draft)
        fits = self.kv_manager.room_for(seq, self._watermark) >= n
        if draft and fits and self.kv_manager.allocate_slots(seq, n):
            step.add(seq, n, True, draft)
            return
        if may_preempt:
            if self._allocate_or_preempt(seq, 1, step):
                step.add(seq, 1, True)
        elif self.kv_manager.allocate_slots(seq, 1):
            step.add(seq, 1, True)

    def _allocate_or_preempt(self, seq: Sequence, num_new_tokens: int, step: StepPlan) -> bool:
        """Make room for ``seq``, the oldest running sequence, by preempting the newest
        other running sequences that this step has not scheduled; False if it could not
        (then it was preempted itself)."""
        while not self.kv_manager.allocate_slots(seq, num_new_tokens):
            others = [
                s for s in self.running if s is not seq and s.request_id not in step.scheduled
            ]
            victim = max(others, key=self._sort_key) if others else seq
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _pending_decodes(self, exclude: Sequence) -> tuple[int, int]:
        """(tokens, query-key pairs) of the running decodes a step will schedule."""
        seqs = [s for s in self.running if s is not exclude and _is_decode(s)]
        return len(seqs), sum(s.num_computed_tokens + 1 for s in seqs)

    def _chunk(
        self, seq: Sequence, step: StepPlan, most: int, extra: tuple[int, int] = (0, 0)
    ) -> int:
        """At most ``most`` of ``seq``'s next prompt tokens: what keeps the step within
        ``max_step_ms`` (with ``extra`` tokens and pairs still to come), never under one
        block's worth, so a prompt always progresses."""
        target = self.config.max_step_ms
        if target is None or most <= 0:
            return most
        tokens = self.config.max_num_batched_tokens - step.budget + extra[0]
        fit = self.step_cost.tokens_within(
            target, tokens, step.pairs + extra[1], seq.num_computed_tokens, most
        )
        return max(fit, min(most, self.kv_manager.block_size))

    def _preempt(self, seq: Sequence, step: StepPlan) -> None:
        _remove(self.running, seq)
        step.drop(seq)
        step.preempted.append(seq.request_id)
        self.num_preemptions += 1
        swap = self.config.preemption_mode == "swap"
        if swap and self.kv_manager.can_swap_out(seq):
            step.swap_out.extend(self.kv_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, seq)
            return
        # Recompute: its output tokens stay, so it later prefills prompt + outputs
        # (mostly prefix-cache hits when caching is on).
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def _schedule_swapped(self, step: StepPlan) -> None:
        kv = self.kv_manager
        while self.swapped and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            if not kv.can_swap_in(seq, n, self._watermark):
                return
            self.swapped.pop(0)
            step.swap_in.extend(kv.swap_in(seq))
            if not kv.allocate_slots(seq, n):
                raise RuntimeError(f"{seq.request_id}: no room after can_swap_in said yes")
            self._start_running(seq, n, step)

    def _schedule_waiting(self, step: StepPlan) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                return  # preempted with a token in flight: it must know it to recompute
            admitted = self._admit(seq, step)
            if admitted is None:
                return  # head-of-line: later requests must not overtake it
            num_hit, n, forked = admitted
            self.waiting.pop(0)
            seq.num_computed_tokens = num_hit
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
                seq.num_cached_tokens = num_hit
                if seq.fork_of is not None:  # counted once per sample, at its first admission
                    self.num_forked += forked
                    self.num_fork_fallbacks += not forked
            self._start_running(seq, n, step)

    def _admit(self, seq: Sequence, step: StepPlan) -> tuple[int, int, bool] | None:
        """Blocks for a waiting ``seq``: (tokens it need not compute, tokens it computes
        this step, whether it forked), or None when they do not fit. A fork computes only
        the last prompt token; any other admission reuses the prefix cache's hits."""
        kv = self.kv_manager
        parent = self._fork_parent(seq)
        if parent is not None:
            num_hit = seq.num_prompt_tokens - 1
            copies = kv.fork(seq, parent, num_hit, 1)
            if copies is None:
                return None
            step.copies.extend(copies)
            return num_hit, 1, True
        blocks, num_hit = kv.get_computed_blocks(seq)
        n = self._chunk(seq, step, min(seq.num_tokens - num_hit, step.budget))
        # Admitted above the watermark only, with a first chunk that fits there.
        n = min(n, kv.room_for(seq, self._watermark, blocks))
        if n <= 0 or not kv.allocate_slots(seq, n, blocks):
            return None
        return num_hit, n, False

    def _fork_parent(self, seq: Sequence) -> Sequence | None:
        """The sequence ``seq`` forks from: the one it names, while that one runs with the
        same prompt computed and ``seq`` has nothing of its own yet. None: admit it as any
        other (a parent finished, preempted, aborted or mid-prompt is never waited for)."""
        if seq.fork_of is None or seq.num_output_tokens or seq.num_prompt_tokens < 2:
            return None
        parent = self._requests.get(seq.fork_of)
        if parent is None or parent.status is not SequenceStatus.RUNNING:
            return None
        if parent.num_computed_tokens < seq.num_prompt_tokens:
            return None
        return parent if parent.prompt_token_ids == seq.prompt_token_ids else None

    def _start_running(self, seq: Sequence, num_new_tokens: int, step: StepPlan) -> None:
        seq.status = SequenceStatus.RUNNING
        self._insert(self.running, seq)
        step.add(seq, num_new_tokens, _is_decode(seq))

    # -- results ------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Advance every scheduled sequence, append sampled tokens, finish the stopped."""
        self.commit(sched_out)
        return self.resolve(sched_out, runner_out)

    def commit(self, sched_out: SchedulerOutput) -> None:
        """The step was launched: its tokens are computed, and each sequence it samples
        gets a placeholder for the token (``resolve`` fills it in)."""
        for item in sched_out.scheduled:
            seq = item.seq
            if self._requests.get(seq.request_id) is not seq:
                continue  # aborted (or failed) while the step was launched
            seq.num_computed_tokens += item.num_own_tokens  # drafts count once accepted
            self.kv_manager.cache_full_blocks(seq)
            if item.samples:
                seq.output_token_ids.append(PLACEHOLDER)
                seq.num_pending += 1

    def resolve(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """The committed step's sampled ids: fill its placeholders, finish the stopped."""
        samples = _index_samples(runner_out)
        outputs = []
        for item in sched_out.scheduled:
            seq = item.seq
            if self._requests.get(seq.request_id) is not seq:
                continue  # aborted, failed or finished while the step was in flight
            if not item.samples:
                continue  # mid-prefill chunk: nothing to report yet
            if seq.request_id not in samples:
                raise ValueError(f"runner output has no token for {seq.request_id}")
            if not seq.num_pending:
                raise RuntimeError(f"{seq.request_id}: a sampled token without its placeholder")
            token_id, logprob = samples[seq.request_id]
            # Steps resolve in launch order, so this step's placeholder is the oldest.
            index = seq.num_output_tokens - seq.num_pending
            outputs.append(self._append_token(seq, index, token_id, logprob))
            if item.draft_token_ids:
                more = runner_out.more_tokens.get(seq.request_id, [])
                outputs += self._accept_draft(seq, item.draft_token_ids, token_id, more)
        return outputs

    def _accept_draft(
        self,
        seq: Sequence,
        draft: tuple[int, ...],
        first: int,
        more: list[tuple[int, TokenLogprob | None]],
    ) -> list[RequestOutput]:
        """The tokens a verified draft emits after its first, each appended as a token of
        its own; the accepted draft tokens' K/V (computed this step) count as inputs."""
        self.drafts.accepted(seq, draft, [first] + [token for token, _ in more])
        outputs = []
        for token_id, logprob in more:
            if seq.is_finished:
                break  # a stop inside the accepted run: the rest goes
            seq.num_computed_tokens += 1  # the previous token, an accepted draft token
            self.kv_manager.cache_full_blocks(seq)
            seq.output_token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
            outputs.append(self._append_token(seq, seq.num_output_tokens - 1, token_id, logprob))
        if not seq.is_finished:  # roll back the rejected draft's slots
            self.kv_manager.trim(seq, seq.num_tokens)
        return outputs

    def _append_token(
        self, seq: Sequence, index: int, token_id: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        seq.output_token_ids[index] = token_id
        seq.num_pending -= 1
        if seq.num_prompt_tokens + index < seq.num_computed_tokens:
            # Already an input (asynchronous output): its block may be full now.
            self.kv_manager.cache_full_blocks(seq)
        if seq.first_token_time is None:
            seq.first_token_time = self.clock()
        num_output = index + 1
        reason, stop_token_id = self._stop_reason(seq, token_id, num_output)
        if reason is not None:
            del seq.output_token_ids[num_output:]  # a step run past the stop: its token goes
            seq.num_pending = 0
            self._retire(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=(token_id,),
            new_logprobs=(logprob,),
            finished=reason is not None,
            finish_reason=reason,
            stop_token_id=stop_token_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=num_output,
            first_scheduled_time=seq.first_scheduled_time,
        )

    def _stop_reason(
        self, seq: Sequence, token_id: int, num_output: int
    ) -> tuple[FinishReason | None, int | None]:
        """Why ``seq`` stops at its ``num_output``-th output token, ``token_id``."""
        params = seq.sampling_params
        # The first min_tokens tokens were sampled with the stop tokens masked
        # (compute/sampling/logit_processors.py): none of them ends the request.
        stops = num_output > params.min_tokens
        if stops and token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, token_id
        if stops and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if self._ends_by_length(seq, num_output):
            return FinishReason.LENGTH, None
        return None, None

    def _ends_by_length(self, seq: Sequence, num_output: int) -> bool:
        num_tokens = seq.num_prompt_tokens + num_output
        return (
            num_output >= seq.sampling_params.max_tokens or num_tokens >= self.limits.max_model_len
        )

    def _ends_when_resolved(self, seq: Sequence) -> bool:
        """A pending token already ends ``seq`` by length: no step may follow it."""
        return seq.num_pending > 0 and self._ends_by_length(seq, seq.num_output_tokens)

    # -- helpers ------------------------------------------------------------

    def _sort_key(self, seq: Sequence) -> tuple:
        return self._order[seq.request_id]

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._sort_key)


def _is_decode(seq: Sequence) -> bool:
    """Generating one token per step (as opposed to computing a prompt or recomputing)."""
    return seq.num_output_tokens > 0 and seq.num_tokens - seq.num_computed_tokens == 1


def _remove(queue: list[Sequence], seq: Sequence) -> None:
    # By identity: Sequence is a dataclass, so == would compare every field.
    for i, other in enumerate(queue):
        if other is seq:
            del queue[i]
            return
    raise ValueError(f"{seq.request_id} is not in the queue")


def _index_samples(
    runner_out: ModelRunnerOutput,
) -> dict[str, tuple[int, TokenLogprob | None]]:
    ids, tokens, logprobs = (
        runner_out.request_ids,
        runner_out.sampled_token_ids,
        runner_out.logprobs,
    )
    if not len(ids) == len(tokens) == len(logprobs):
        raise ValueError("runner output: request_ids, sampled_token_ids, logprobs differ in length")
    return {rid: (tok, lp) for rid, tok, lp in zip(ids, tokens, logprobs, strict=True)}
