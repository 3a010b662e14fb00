"""Preemption beyond running out of blocks (which the scheduler does itself): a waiting request of
a higher tier takes the slots or blocks of running ones of a lower tier, and, under fair share, the
least-served waiting tenant takes a slot from a more-served tenant of its tier that holds more
(weighted) slots, within a token bucket on the computed work this throws away."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class Preemption:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        # Fair-share preemption's token bucket: computed tokens it may still throw away. It fills by
        # fair_preempt_tokens_per_step each step up to max_model_len (so any one sequence can be
        # paid for), so over k steps it throws away at most k x that rate + max_model_len tokens.
        self._fair_preempt_allowance = 0
        self.num_fair_preemptions = 0
        self.num_fair_preempted_tokens = 0  # computed tokens fair-share preemption threw away

    def before_step(self) -> list[Sequence]:
        """The sequences preempted before this step is scheduled (already back in the queue)."""
        config = self.sched.config
        rate = config.fair_preempt_tokens_per_step
        assert rate is not None  # resolved by SchedulerConfig
        self._fair_preempt_allowance = min(
            self._fair_preempt_allowance + rate, max(config.max_model_len, rate)
        )
        preempted = self._for_higher_tier()
        if self.sched.fair_share and not preempted:
            preempted = self._for_fair_share()
        return preempted

    def _for_higher_tier(self) -> list[Sequence]:
        """Make room for the head of the waiting queue by preempting running sequences of a lower
        tier (the least important first) when it lacks a sequence slot or blocks for its first chunk."""
        sched = self.sched
        head = sched.waiting.peek()
        if head is None or not sched.running:
            return []
        lower = [s for s in sched.running if s.priority > head.priority]
        if not lower:
            return []
        bm, cfg = sched.block_manager, sched.config
        computed = [] if head.wants_prompt_logprobs else bm.get_computed_blocks(head)
        uncomputed = head.num_tokens - len(computed) * sched.block_size
        budget = max(1, cfg.max_num_batched_tokens - len(sched.running))
        num_new = sched.num_new_tokens(uncomputed, budget) or min(uncomputed, cfg.max_num_batched_tokens)
        lower.sort(key=sched.order_key)
        victims: list[Sequence] = []
        while lower and (
            len(sched.running) >= cfg.max_num_seqs or not bm.can_allocate(head, num_new, computed)
        ):
            victim = lower.pop()
            sched.preempt(victim)
            victims.append(victim)
        return victims

    def _for_fair_share(self) -> list[Sequence]:
        """When every slot is taken and the head of the queue (the least-served waiting tenant's)
        belongs to a tenant holding fewer weighted slots than another tenant of its tier that was
        served more, preempt that tenant's least important sequence to make the head its slot:
        running sequences are otherwise never taken back, and a tenant with many long sequences
        would hold the batch while the others queue. At most one a step, and only what the token
        bucket can pay for (its computed tokens are thrown away and computed again)."""
        sched = self.sched
        cfg = sched.config
        head = sched.waiting.peek()
        if cfg.fair_preempt_tokens_per_step == 0 or head is None or len(sched.running) < cfg.max_num_seqs:
            return []
        if sched.lora_slots is not None and head.lora_id:
            in_use = {s.lora_id for s in sched.running if s.lora_id}
            if not sched.lora_slots.can_admit(head.lora_id, in_use):
                return []
        service = sched.service
        slots: dict[str, int] = {}
        for s in sched.running:
            slots[s.tenant] = slots.get(s.tenant, 0) + 1
        head_share = (slots.get(head.tenant, 0) + 1) / service.weight(head.tenant)
        head_service = service.service(head.tenant)
        victims = sorted(
            (
                s
                for s in sched.running
                if s.priority == head.priority
                and s.tenant != head.tenant
                and service.service(s.tenant) > head_service
                and slots[s.tenant] / service.weight(s.tenant) >= head_share
            ),
            key=sched.order_key,
            reverse=True,
        )
        if not victims:
            return []
        # Only for a slot: the head's first chunk must already find its blocks, or the victim's
        # work would be thrown away for nothing.
        bm = sched.block_manager
        computed = [] if head.wants_prompt_logprobs else bm.get_computed_blocks(head)
        uncomputed = head.num_tokens - len(computed) * sched.block_size
        num_new = sched.num_new_tokens(uncomputed, max(1, cfg.max_num_batched_tokens - len(sched.running)))
        if num_new == 0 or not bm.can_allocate(head, num_new, computed):
            return []
        for victim in victims:
            if victim.num_computed_tokens <= self._fair_preempt_allowance:
                self._fair_preempt_allowance -= victim.num_computed_tokens
                self.num_fair_preemptions += 1
                self.num_fair_preempted_tokens += victim.num_computed_tokens
                sched.preempt(victim)
                return [victim]
        return []
