"""The scheduler's waiting queue and its admission order (after vLLM's sched/request_queue): by
priority tier, then the tenant a policy picks (the least served under fair share, the earliest head
under FCFS), FIFO within a tenant, resumed sequences first."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the queue orders by: a scheduler's Sequence, or an embedding engine's job."""

    @property
    def priority(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def seq_id(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


class _Level(Generic[Q]):
    __slots__ = ("num_resumed", "resumed", "tenants")

    def __init__(self) -> None:
        # Preempted sequences and released siblings: their request was already admitted once.
        self.resumed: deque[Q] = deque()
        # Tenants with new requests, in the order they started waiting; FIFO within a tenant.
        self.tenants: OrderedDict[str, deque[Q]] = OrderedDict()
        # Under fair share resumed sequences wait at the front of their own tenant's queue instead:
        # how many lead each tenant's queue.
        self.num_resumed: dict[str, int] = {}


class WaitingQueue(Generic[Q]):
    """Waiting sequences in admission order: by priority; within a priority, the head of the tenant
    that `choose` picks among those waiting (the least served under fair share, the earliest head
    under FCFS), FIFO within a tenant. Resumed sequences (preempted, or siblings released) go first:
    under FCFS before every tenant, under fair share before their own tenant's new requests, so that
    a preempted sequence of the most-served tenant does not take back the slot its preemption made."""

    def __init__(
        self,
        choose: Callable[[OrderedDict[str, deque[Q]]], str] | None = None,
        *,
        resumed_by_tenant: bool = False,
    ) -> None:
        self._levels: dict[int, _Level[Q]] = {}
        self._len = 0
        self._choose = choose or _earliest_head
        self._by_tenant = resumed_by_tenant

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Q]:
        for p in sorted(self._levels):
            level = self._levels[p]
            yield from level.resumed
            for q in level.tenants.values():
                yield from q

    def heads(self, per_tenant: int = 1) -> Iterator[Q]:
        """The resumed sequences and each tenant's first `per_tenant` waiting ones: those that may
        start next."""
        for p in sorted(self._levels):
            level = self._levels[p]
            yield from level.resumed
            for q in level.tenants.values():
                yield from itertools.islice(q, per_tenant)

    def push(self, seq: Q, *, resumed: bool = False, first: bool = False) -> None:
        level = self._levels.setdefault(seq.priority, _Level[Q]())
        self._len += 1
        if resumed and self._by_tenant:
            q = level.tenants.setdefault(seq.tenant, deque())
            ahead = level.num_resumed.get(seq.tenant, 0)
            q.insert(0 if first else ahead, seq)
            level.num_resumed[seq.tenant] = ahead + 1
            return
        q = level.resumed if resumed else level.tenants.setdefault(seq.tenant, deque())
        q.appendleft(seq) if first else q.append(seq)

    def peek(self) -> Q | None:
        if not self._levels:
            return None
        level = self._levels[min(self._levels)]
        return level.resumed[0] if level.resumed else level.tenants[self._choose(level.tenants)][0]

    def pop(self) -> Q:
        p = min(self._levels)
        level = self._levels[p]
        if level.resumed:
            seq = level.resumed.popleft()
        else:
            tenant = self._choose(level.tenants)
            q = level.tenants[tenant]
            seq = q.popleft()
            self._forget_resumed(level, tenant, 0)
            if q:
                level.tenants.move_to_end(tenant)  # ties go to the others next
            else:
                del level.tenants[tenant]
        self._drop_if_empty(p)
        self._len -= 1
        return seq

    def remove(self, seq: Q) -> bool:
        level = self._levels.get(seq.priority)
        if level is None:
            return False
        tenant_queue = level.tenants.get(seq.tenant)
        for q in (level.resumed, *([tenant_queue] if tenant_queue is not None else [])):
            if seq in q:
                if q is not level.resumed:
                    self._forget_resumed(level, seq.tenant, q.index(seq))
                q.remove(seq)
                if not level.tenants.get(seq.tenant, True):
                    del level.tenants[seq.tenant]
                self._drop_if_empty(seq.priority)
                self._len -= 1
                return True
        return False

    @staticmethod
    def _forget_resumed(level: _Level[Q], tenant: str, position: int) -> None:
        """The sequence at `position` of `tenant`'s queue leaves it: one resumed fewer if it was one."""
        ahead = level.num_resumed.get(tenant, 0)
        if position < ahead:
            if ahead == 1:
                del level.num_resumed[tenant]
            else:
                level.num_resumed[tenant] = ahead - 1

    def _drop_if_empty(self, priority: int) -> None:
        level = self._levels[priority]
        if not level.resumed and not level.tenants:
            del self._levels[priority]


def _earliest_head(tenants: OrderedDict[str, deque[Q]]) -> str:
    return min(tenants, key=lambda t: (tenants[t][0].arrival_time, tenants[t][0].seq_id))
