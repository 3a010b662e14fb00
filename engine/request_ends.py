"""Requests that end for a reason from outside the step: an abort (the client went away, a cancel),
applied at the next schedule(), and a queue deadline that passed before any of the request was
computed (it is dropped, unbilled, with queue_timeout). A request that has started runs to its end
whatever its deadline."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.protocol import ErrorCode, FinishReason
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class RequestEnds:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._pending_aborts: dict[str, None] = {}
        self._num_deadlines = 0  # unfinished requests with a queue deadline
        self.num_expired = 0

    def started_tracking(self, first: Sequence) -> None:
        """A request's first sequence was added."""
        if first.deadline is not None:
            self._num_deadlines += 1

    def stopped_tracking(self, last: Sequence) -> None:
        """A request's last sequence was discarded."""
        self._pending_aborts.pop(last.request_id, None)
        if last.deadline is not None:
            self._num_deadlines -= 1

    def abort(self, request_id: str) -> bool:
        self._pending_aborts[request_id] = None
        return True

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences that end now: (aborted, expired), already out of every queue."""
        aborted = self._aborted()
        expired = self._expired() if self._num_deadlines else []
        return aborted, expired

    def _aborted(self) -> list[Sequence]:
        sched = self.sched
        aborted: list[Sequence] = []
        for request_id in list(self._pending_aborts):
            for seq in list(sched.requests.get(request_id, ())):
                sched.discard(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT
                aborted.append(seq)
        self._pending_aborts.clear()
        return aborted

    def _expired(self) -> list[Sequence]:
        """Drop the requests whose queue deadline passed while none of their sequences had started."""
        sched = self.sched
        now = time.time()
        expired: list[Sequence] = []
        for seqs in list(sched.requests.values()):
            deadline = seqs[0].deadline
            if deadline is None or deadline > now:
                continue
            if any(s.status is not SequenceStatus.WAITING or s.num_prompt_tokens_charged for s in seqs):
                continue  # started: it runs to its end
            for seq in list(seqs):
                sched.discard(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, ErrorCode.QUEUE_TIMEOUT
                expired.append(seq)
        self.num_expired += len({s.request_id for s in expired})
        return expired
