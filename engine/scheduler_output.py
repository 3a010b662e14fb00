"""What the scheduler hands the model runner each step: the sequences it runs, and how much of each."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # a prefill chunk, or 1 for a decode (plus its draft's length)
    # Tokens proposed after the sequence's last one (speculative decoding, engine.speculative):
    # fed after it in this step, and verified by sampling at each of their positions.
    draft: list[int] = field(default_factory=list)
    # Snapshotted at schedule time: positions [start_pos, start_pos + num_new_tokens) are computed.
    start_pos: int = field(init=False)
    # True when this step computes the sequence's last token, so the runner must sample for it.
    needs_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start_pos = self.seq.num_computed_tokens
        self.needs_sample = self.start_pos + self.num_new_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def end_pos(self) -> int:
        """End of the sequence's own tokens computed this step (the draft's positions follow)."""
        return self.start_pos + self.num_new_tokens - len(self.draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[Sequence]
    finished_aborted: list[Sequence]
    # Dropped unstarted because their queue deadline passed (finish_reason "queue_timeout").
    finished_expired: list[Sequence] = field(default_factory=list)
