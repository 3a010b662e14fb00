"""Weighted fair sharing of service across tenants, after the Virtual Token Counter (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it received divided by its weight, where service is the
prompt tokens computed for it plus twice its output tokens. The scheduler admits, and hands the
chunked-prefill budget to, the backlogged tenant with the least counter, and preempts from the
most-served one (for room in the KV cache, and, within a bound on the work thrown away, for a
sequence slot when a tenant holding fewer slots waits; see Scheduler). A tenant that becomes active
again is lifted to the least counter among the active ones, so idle time banks no credit: it cannot
later crowd out the tenants that kept working.
"""

from __future__ import annotations

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


class ServiceCounters:
    __slots__ = ("_active", "_floor", "_served", "_service", "_weight")

    def __init__(self) -> None:
        self._service: dict[str, float] = {}  # weighted (virtual) service: what ordering uses
        self._served: dict[str, float] = {}  # unweighted service, for stats
        self._weight: dict[str, float] = {}
        self._active: dict[str, int] = {}  # unfinished sequences per tenant
        # The virtual time while nobody is active: the counter of the last tenant that went idle.
        self._floor = 0.0

    def activate(self, tenant: str, weight: float) -> None:
        """A sequence of `tenant` arrived; the tenant's latest weight applies from now on."""
        self._weight[tenant] = weight
        count = self._active.get(tenant, 0)
        if count == 0:
            lift = min((self._service[t] for t in self._active), default=self._floor)
            self._service[tenant] = max(self._service.get(tenant, 0.0), lift)
            self._served.setdefault(tenant, 0.0)
        self._active[tenant] = count + 1

    def deactivate(self, tenant: str) -> None:
        """A sequence of `tenant` finished (or was dropped)."""
        count = self._active[tenant] - 1
        if count:
            self._active[tenant] = count
            return
        del self._active[tenant]
        if not self._active:
            self._floor = max(self._floor, self._service[tenant])
        if len(self._service) > 4 * len(self._active) + 256:
            self._prune()

    def _prune(self) -> None:
        # An idle tenant at or below the least active counter would be lifted on return anyway.
        lift = min((self._service[t] for t in self._active), default=self._floor)
        for tenant in [t for t, s in self._service.items() if t not in self._active and s <= lift]:
            del self._service[tenant], self._weight[tenant], self._served[tenant]

    def charge(self, tenant: str, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        if cost:
            self._service[tenant] += cost / self._weight[tenant]
            self._served[tenant] += cost

    def service(self, tenant: str) -> float:
        return self._service.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weight.get(tenant, 1.0)

    def is_active(self, tenant: str) -> bool:
        return tenant in self._active

    def active(self) -> dict[str, int]:
        """Unfinished sequences per active tenant (read-only: the counters' own)."""
        return self._active

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per active tenant: its weight, weighted counter and unweighted service."""
        return {
            t: {"weight": self._weight[t], "counter": self._service[t], "served": self._served[t]}
            for t in self._active
        }
