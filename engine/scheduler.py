"""Iteration-level scheduling: one token budget per step shared by decodes and prefill chunks.

Order of service: priority tier first (a lower number is more important), then, within a tier,
the tenant with the least weighted service (engine.fair_share), then arrival. Running sequences
get the step's budget in that order; when blocks run out the last in that order is preempted by
recompute (the lowest tier, its most-served tenant, its latest arrival), and a waiting request of
a higher tier preempts running ones of a lower tier. Under fair share, when every slot is taken,
the least-served waiting tenant also preempts a sequence of a more-served tenant of its tier that
holds more (weighted) slots, within a token bucket on the computed work this throws away
(fair_preempt_tokens_per_step; engine.preemption). Waiting sequences are admitted in the same order
(engine.admission). A request may run at most max_seqs_per_request sequences. A waiting request
whose queue deadline passes before any of it was computed is dropped (engine.request_ends, with
aborts).
While several tenants have work in a step, its decodes and prompt tokens stay within
shared_step_slowdown times the least demanding tenant's own step: the widest tenants' decodes take
turns and their prompts are computed a chunk a step (engine.step_width).
`policy="fcfs"` orders within a tier by arrival alone (the baseline fair share is measured against).
With speculative decoding (engine.speculative) a decoding sequence's step also carries its draft,
where the budget and free blocks allow it, and update_from_output rolls back what was rejected.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping

from engine.admission import Admission, check_fits, check_num_seqs
from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.errors import EngineError
from engine.fair_share import ServiceCounters
from engine.lora.slots import LoRASlots
from engine.preemption import Preemption
from engine.protocol import ErrorCode
from engine.request_ends import RequestEnds
from engine.request_queue import WaitingQueue
from engine.rules import SPARE_CAPACITY_PRIORITY
from engine.scheduler_output import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import Speculator
from engine.step_width import SharedStepWidth, StepShare

# A sequence dropped unstarted (its queue deadline passed): its request ends with this error code.
FINISH_QUEUE_TIMEOUT = ErrorCode.QUEUE_TIMEOUT


class TierGate:
    """What one step gives sequences of less important tiers than its most important running one
    (SchedulerConfig.lower_tier_prefill_tokens): while a prompt of that tier waits to start or is
    being computed (its time to first token), no prompt tokens, and for the spare-capacity tier
    (`flex`) no decodes either in a step that computes such a prompt, so that its prefill carries
    none of their rows; else at most `cap` prompt tokens."""

    def __init__(self, top: int | None, left: int | None, prompt_first: bool = False) -> None:
        self.top, self.left = top, left
        self.prompt_first = prompt_first  # a prompt of tier `top` waits or is being computed

    @classmethod
    def for_step(cls, cap: int | None, running: list[Sequence], first_waiting: Sequence | None) -> TierGate:
        if cap is None or not running:
            return cls(None, None)
        top = min(s.priority for s in running)
        if first_waiting is not None and first_waiting.priority <= top:
            return cls(first_waiting.priority, 0, prompt_first=True)
        if any(s.priority == top and s.num_uncomputed_tokens > 1 for s in running):
            return cls(top, 0, prompt_first=True)
        return cls(top, cap)

    def allow(self, seq: Sequence, tokens: int) -> int:
        if self.left is None or self.top is None or seq.priority <= self.top:
            return tokens
        return min(tokens, self.left)

    def holds_decode(self, seq: Sequence) -> bool:
        """Whether this decode of the spare-capacity tier waits until the step is known to compute
        no more important prompt."""
        return (
            self.prompt_first
            and self.top is not None
            and seq.priority > self.top
            and seq.priority >= SPARE_CAPACITY_PRIORITY
        )

    def computes_prompt(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether the step computes prompt tokens of a sequence of tier `top` or a more important one."""
        return self.top is not None and any(
            item.seq.priority <= self.top
            and (item.end_pos - item.start_pos > 1 or item.start_pos < item.seq.num_prompt_tokens)
            for item in scheduled
        )

    def charge(self, seq: Sequence, tokens: int) -> None:
        if self.left is not None and self.top is not None and seq.priority > self.top:
            self.left -= tokens


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        lora_slots: LoRASlots | None = None,
        speculator: Speculator | None = None,
        *,
        window: int | None = None,
        num_window_blocks: int = 0,
    ) -> None:
        """``window``, ``num_window_blocks``: the windowed layers' KV pool (engine.block_manager)."""
        self.config = scheduler_config
        # Drafts for decoding sequences (speculative decoding); None: one token per decode.
        self.speculator = speculator
        # Device slots for adapters: a step never runs more distinct adapters than there are slots.
        self.lora_slots = lora_slots
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            window=window if num_window_blocks else None,
            num_window_blocks=num_window_blocks,
        )
        self.fair_share = scheduler_config.policy == "fair"
        self.service = ServiceCounters()
        self.waiting = WaitingQueue(
            self._least_served if self.fair_share else None, resumed_by_tenant=self.fair_share
        )
        self.running: list[Sequence] = []
        # Siblings (index > 0) of a parallel-sampling request, held until index 0's prompt is
        # computed so that they share its cached blocks instead of computing them again.
        self._held: dict[str, list[Sequence]] = {}
        self.requests: dict[str, list[Sequence]] = {}  # unfinished sequences by request id
        self.num_preemptions = 0
        self.preemption = Preemption(self)
        self.tiers = TierGate(None, None)  # this step's (schedule() sets it)
        self.ends = RequestEnds(self)
        self.admission = Admission(self)
        # While tenants share the replica, the widest ones' decodes take turns (engine.step_width).
        self.step_width = SharedStepWidth(
            scheduler_config.shared_step_slowdown,
            scheduler_config.decode_fixed_rows,
            scheduler_config.prompt_token_rows,
            decode_key_rows=scheduler_config.decode_key_rows,
            prompt_key_rows=scheduler_config.prompt_key_rows,
            prompt_logprob_rows=scheduler_config.prompt_logprob_rows,
        )
        self.share = StepShare()  # this step's (schedule() sets it)
        self.num_steps = 0
        self.num_sat_out = 0  # decodes that sat a step out for the shared step width

    # -- ordering -----------------------------------------------------------------------------

    def _least_served(self, tenants: OrderedDict[str, deque[Sequence]]) -> str:
        service = self.service.service
        return min(tenants, key=service)  # ties: the tenant waiting longest (dict order)

    def order_key(self, seq: Sequence) -> tuple:
        """Most important first; the victim of a preemption is the sequence with the largest key."""
        if self.fair_share:
            return (seq.priority, self.service.service(seq.tenant), seq.arrival_time, seq.seq_id)
        return (seq.priority, seq.arrival_time, seq.seq_id)

    # -- requests in and out ------------------------------------------------------------------

    def check_num_seqs(self, n: int) -> None:
        check_num_seqs(self.config, n)

    def add(self, seq: Sequence) -> None:
        check_fits(self.config, self.block_manager, seq)
        siblings = self.requests.setdefault(seq.request_id, [])
        if any(s.index == seq.index for s in siblings):
            raise EngineError(f"request {seq.request_id!r} already has a sequence with index {seq.index}")
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        siblings.append(seq)
        if len(siblings) == 1:
            self.ends.started_tracking(seq)
        self.service.activate(seq.tenant, seq.weight)
        head = next((s for s in siblings if s.index == 0), None)
        if seq.index > 0 and head is not None and head.num_computed_tokens < head.num_prompt_tokens:
            self._held.setdefault(seq.request_id, []).append(seq)
        else:
            self.waiting.push(seq)

    def abort(self, request_id: str) -> bool:
        """Mark a request aborted; the next schedule() frees its blocks and reports it."""
        return request_id in self.requests and self.ends.abort(request_id)

    def finish(self, seq: Sequence, status: SequenceStatus, reason: str) -> None:
        assert status.is_finished, status
        if seq.is_finished:  # already aborted: nothing left to release
            return
        self.discard(seq)
        seq.status, seq.finish_reason = status, reason

    def discard(self, seq: Sequence) -> None:
        """Take a sequence out of every queue and free what it holds (its status is the caller's)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not self.waiting.remove(seq):
            self._held[seq.request_id].remove(seq)
            if not self._held[seq.request_id]:
                del self._held[seq.request_id]
        self.block_manager.free(seq)
        self.service.deactivate(seq.tenant)
        siblings = self.requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self.requests[seq.request_id]
            self.ends.stopped_tracking(seq)
        elif seq.index == 0:
            self.release_siblings(seq.request_id)  # nothing left to wait for

    def release_siblings(self, request_id: str) -> None:
        for seq in self._held.pop(request_id, ()):
            self.waiting.push(seq, resumed=True)

    # -- one step -----------------------------------------------------------------------------

    def num_new_tokens(self, num_uncomputed: int, budget: int) -> int:
        """Tokens to compute this step, or 0 when the sequence must wait for a bigger budget."""
        if num_uncomputed <= budget:
            return num_uncomputed
        threshold = self.config.long_prefill_token_threshold
        if self.config.enable_chunked_prefill or (threshold > 0 and num_uncomputed >= threshold):
            return budget
        return 0

    def grant(
        self, scheduled: list[ScheduledSequence], seq: Sequence, num_new: int, draft: list[int] | None = None
    ) -> None:
        item = ScheduledSequence(seq, num_new, draft or [])
        scheduled.append(item)
        if seq.num_uncomputed_tokens == 1:
            seq.last_decode_step = self.num_steps
        # Prompt tokens are service when computed (a cache hit or a recompute of outputs is not);
        # charged now, so the order of the rest of this step already sees them.
        end = min(item.start_pos + num_new, seq.num_prompt_tokens)
        prompt = end - max(item.start_pos, seq.num_prompt_tokens_charged)
        if prompt > 0:
            self.service.charge(seq.tenant, prompt_tokens=prompt)
            seq.num_prompt_tokens_charged = end

    def prompt_start(self, seq: Sequence) -> int:
        """Where a waiting sequence's start would begin computing: past the prefix-cache hits it
        would claim (none where it wants prompt logprobs, as admission)."""
        if seq.block_table or seq.num_computed_tokens or seq.wants_prompt_logprobs:
            return seq.num_computed_tokens
        return len(self.block_manager.get_computed_blocks(seq)) * self.block_size

    def allow_prompt(self, seq: Sequence, tokens: int, start: int | None = None) -> int:
        """The prompt tokens of `tokens` that `seq` may compute this step, from `start` (by default
        its computed tokens): what the tier gate and the shared step width leave it."""
        return self.share.allow(seq, self.tiers.allow(seq, tokens), start)

    def charge_prompt(self, seq: Sequence, tokens: int) -> None:
        """`seq` computes `tokens` prompt tokens this step, from its computed tokens."""
        self.tiers.charge(seq, tokens)
        self.share.charge(seq, tokens)

    def schedule(self) -> SchedulerOutput:
        aborted, expired = self.ends.take()
        self.num_steps += 1
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = self.preemption.before_step()
        made_room = bool(preempted)

        # Running sequences, most important first; the victims come from the tail, which has
        # not been scheduled yet, so nothing already granted this step is taken back.
        order = sorted(self.running, key=self.order_key)
        # Prompt tokens this step may compute: capped while sequences decode (see SchedulerConfig).
        cap = self.config.max_prefill_tokens_with_decodes
        decoding = (
            cap > 0
            and self.config.enable_chunked_prefill
            and any(s.num_uncomputed_tokens == 1 for s in self.running)
        )
        prefill_budget = cap if decoding else self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill:
            spare_cap = self.step_width.spare_prompt_tokens(
                self.running, self.waiting.peek(), self.config.max_num_seqs
            )
            if spare_cap is not None:
                prefill_budget = min(prefill_budget, spare_cap)
        self.tiers = TierGate.for_step(
            self.config.lower_tier_prefill_tokens, self.running, self.waiting.peek()
        )
        held: list[Sequence] = []  # less important decodes, granted unless a prompt goes first
        free_slots = self.config.max_num_seqs - len(self.running)
        self.share = self.step_width.plan(
            self.running,
            self.waiting.heads(free_slots) if free_slots > 0 else (),
            self.service.active(),
            min(self.config.max_num_batched_tokens, prefill_budget),
            self.prompt_start,
        )
        sit_out = self.share.sit_out
        self.num_sat_out += len(sit_out)
        i = 0
        while i < len(order) and budget > 0:
            seq: Sequence | None = order[i]
            assert seq is not None
            uncomputed = seq.num_uncomputed_tokens
            if uncomputed == 1 and seq.seq_id in sit_out:
                i += 1
                continue
            if uncomputed == 1 and self.tiers.holds_decode(seq):
                held.append(seq)
                i += 1
                continue
            num_new = self.num_new_tokens(
                uncomputed,
                budget if uncomputed == 1 else self.allow_prompt(seq, min(budget, prefill_budget)),
            )
            if num_new == 0:
                i += 1
                continue
            draft: list[int] = []
            if uncomputed == 1 and self.speculator is not None and budget > 1:
                # A draft rides along only where its slots are free: never a preemption for it.
                draft = self.speculator.draft(seq, budget - 1)
                if draft and bm.can_allocate(seq, 1 + len(draft)):
                    num_new += len(draft)
                else:
                    draft = []
            while not bm.can_allocate(seq, num_new):
                victim = order.pop()
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                self.grant(scheduled, seq, num_new, draft)
                budget -= num_new
                if uncomputed > 1:
                    prefill_budget -= num_new
                    self.charge_prompt(seq, num_new)
                i += 1

        # Admitting while preempting for room would only evict what was just admitted on the next
        # step; a preemption for a higher tier or for fair share made room for exactly what is
        # admitted now.
        if made_room or not preempted:
            budget, prefill_budget = self.admission.admit(scheduled, budget, prefill_budget)
        if held and not self.tiers.computes_prompt(scheduled):
            budget = self._grant_held(scheduled, held, budget)

        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted=preempted,
            finished_aborted=aborted,
            finished_expired=expired,
        )

    def _grant_held(self, scheduled: list[ScheduledSequence], held: list[Sequence], budget: int) -> int:
        """The held decodes, after all: the more important prompt did not start this step. One that
        lost its slot to a preemption meanwhile, or finds no free block, waits for the next step."""
        for seq in held:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and self.block_manager.can_allocate(seq, 1):
                self.block_manager.allocate(seq, 1)
                self.grant(scheduled, seq, 1)
                budget -= 1
        return budget

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop its KV, keep its outputs, requeue it ahead of new work."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq, resumed=True, first=True)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[int, list[int]]
    ) -> list[Sequence]:
        """Advance the scheduled sequences past this step; return those that received tokens (one,
        or with a draft the accepted ones and the token sampled after them: engine.speculative).

        A draft's rejected positions are rolled back: the computed length ends after the last
        accepted token, and the blocks past the next token's are freed before any block is
        registered in the prefix cache, so only accepted tokens' KV is ever shared."""
        bm = self.block_manager
        sampled: list[Sequence] = []
        for item in scheduler_output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # finished between schedule and update
                continue
            assert seq.num_computed_tokens == item.start_pos, (
                "update_from_output must follow its own schedule()"
            )
            tokens = sampled_token_ids[seq.seq_id] if item.needs_sample else []
            num_accepted = max(0, len(tokens) - 1)
            assert num_accepted <= len(item.draft)
            seq.num_computed_tokens = item.end_pos + num_accepted
            if item.draft:
                bm.trim(seq, seq.num_computed_tokens + 1)
                rejected = len(item.draft) - num_accepted
                # Computed and thrown away: service (fair share) like prompt work, not output.
                self.service.charge(seq.tenant, prompt_tokens=rejected)
                assert self.speculator is not None
                self.speculator.record(seq, len(item.draft), num_accepted)
            if tokens:
                for token in tokens:
                    seq.append_token(token)
                self.service.charge(seq.tenant, output_tokens=len(tokens))
                sampled.append(seq)
            bm.cache_full_blocks(seq)  # after the accepted drafts are the sequence's own tokens
            bm.release_out_of_window(seq)  # registered first, so the freed blocks stay cached
            if seq.index == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.release_siblings(seq.request_id)
        return sampled

    def compute_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        return self.block_manager.compute_slot_mapping(seq, start, end)

    # -- introspection ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(held) for held in self._held.values())

    @property
    def num_fair_preemptions(self) -> int:
        return self.preemption.num_fair_preemptions

    @property
    def num_fair_preempted_tokens(self) -> int:
        return self.preemption.num_fair_preempted_tokens

    def get_stats(self) -> dict[str, int | float]:
        bm = self.block_manager
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_stats()["hit_rate"],
            "num_preemptions": self.num_preemptions,
            "num_expired": self.ends.num_expired,
            "num_sat_out": self.num_sat_out,
        }
