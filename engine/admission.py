"""Admission: whether a request can ever run on this engine (its size against the cache and the
context), and which waiting sequences start this step.

Waiting sequences start in the scheduler's order (tier, then fair share, then arrival) while the
step has token budget, a free slot and KV blocks, each reusing what the prefix cache holds of it.
The order is strict: a big request at the head is never overtaken, so it cannot starve. Two
exceptions: a head whose adapter finds no device slot waits for one, while base-model requests
behind it (which take no slot) run meanwhile; and a head whose tenant has spent its rows of a
shared step (engine.step_width) waits for the next step, while the other tenants' heads start
(its tenant's rows come back every step, so it starts no later than its own running work allows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.errors import RequestTooLargeError
from engine.scheduler_output import ScheduledSequence
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def check_num_seqs(config: SchedulerConfig, n: int) -> None:
    """Refuse a request of more sequences than max_seqs_per_request: it would hold too many of the
    slots every tenant shares."""
    limit = config.max_seqs_per_request
    assert limit is not None  # resolved by SchedulerConfig
    if n > limit:
        raise RequestTooLargeError(
            f"n={n}: a request may run at most {limit} sequences on this engine (max_seqs_per_request)"
        )


def check_fits(config: SchedulerConfig, blocks: BlockManager, seq: Sequence) -> None:
    """Refuse a sequence that could never run here: a prompt beyond max_model_len, or a prompt plus
    max_tokens needing more KV blocks than the whole cache."""
    check_num_seqs(config, getattr(seq.sampling_params, "n", 1))
    if seq.num_prompt_tokens > config.max_model_len:
        raise RequestTooLargeError(
            f"the prompt has {seq.num_prompt_tokens} tokens, more than max_model_len={config.max_model_len}"
        )
    max_tokens = seq.max_tokens
    max_len = (
        config.max_model_len
        if max_tokens is None
        else min(seq.num_prompt_tokens + max_tokens, config.max_model_len)
    )
    if blocks.num_blocks_for(max_len) > blocks.num_total_blocks:
        raise RequestTooLargeError(
            f"prompt plus max_tokens ({max_len} tokens) needs {blocks.num_blocks_for(max_len)} KV cache "
            f"blocks but the engine has {blocks.num_total_blocks} of {blocks.block_size} tokens"
        )


class Admission:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def admit(self, scheduled: list[ScheduledSequence], budget: int, prefill_budget: int) -> tuple[int, int]:
        """Start waiting sequences into this step; returns the budgets left."""
        sched = self.sched
        bm, waiting, lora_slots = sched.block_manager, sched.waiting, sched.lora_slots
        loras_in_use = {s.lora_id for s in sched.running if s.lora_id} if lora_slots is not None else set()
        spent: set[str] = set()  # tenants whose rows of this shared step are spent
        while min(budget, prefill_budget) > 0 and len(sched.running) < sched.config.max_num_seqs:
            seq = waiting.peek()
            if seq is None:
                break
            if lora_slots is not None and not lora_slots.can_admit(seq.lora_id, loras_in_use):
                seq = next((s for s in waiting if s.lora_id == 0 and s.tenant not in spent), None)
            elif seq.tenant in spent:
                seq = next(
                    (
                        s
                        for s in waiting.heads()
                        if s.tenant not in spent
                        and (lora_slots is None or lora_slots.can_admit(s.lora_id, loras_in_use))
                    ),
                    None,
                )
            if seq is None:
                break
            # Prompt logprobs come out of the prompt's own forward passes: nothing is reused.
            computed = [] if seq.wants_prompt_logprobs else bm.get_computed_blocks(seq)
            num_hit = len(computed) * sched.block_size
            allowed = sched.allow_prompt(seq, min(budget, prefill_budget), num_hit)
            if allowed == 0 and sched.share.bounded:
                spent.add(seq.tenant)
                continue
            num_new = sched.num_new_tokens(seq.num_tokens - num_hit, allowed)
            if num_new == 0 or not bm.can_allocate(seq, num_new, computed):
                break
            if seq is waiting.peek():
                waiting.pop()
            else:
                waiting.remove(seq)
            bm.allocate(seq, num_new, computed)
            if lora_slots is not None and seq.lora_id:
                lora_slots.acquire(seq.lora_id, loras_in_use)
                loras_in_use.add(seq.lora_id)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)
            sched.grant(scheduled, seq, num_new)
            budget -= num_new
            prefill_budget -= num_new
            sched.charge_prompt(seq, num_new)
        return budget, prefill_budget
