"""How many rows a step may carry while several tenants share the replica.

On a CPU a step's time grows with its rows: reading the weights is a fixed cost, and every
sequence decoded and every prompt token computed adds its own products. A tenant that runs a
hundred sequences, or sends prompt after prompt of a thousand tokens (paid for, token by token),
would otherwise make every step, and so every other tenant's time between tokens, many times
longer: a step that computes a 2,048-token prompt chunk takes over a hundred times a one-sequence
decode step there.

A tenant's demand on a step is its rows: one per sequence it decodes, and `prompt_token_rows` (a
prompt token's cost over a decoded sequence's) per prompt token it could compute, for its prompts
being computed and the first it has waiting while a slot is free. A tenant present without
demand (its sequences wait for a slot, or all finished less than LINGER_S ago: its client's next
request is on its way) counts one row. While two or more tenants are present, a step carries at
most

    width = (slowdown - 1) * fixed_rows + slowdown * least

rows, where `least` is the smallest demand and `fixed_rows` is the step's fixed cost in rows of
per-sequence cost (with a step of b decodes taking a + c * b seconds, fixed_rows = a / c). A step
of that width takes at most `slowdown` times the step the least demanding tenant would run alone.

The rows are shared by one cap per tenant, the largest that keeps the step within the width, and
never below `least` (water-filling: tenants demanding no more than the least one are never held
back, and tenants of equal demand run together as before). A tenant spends its cap on its decodes
first: above the cap, its sequences take turns, each step decoding those that decoded least
recently, while the others keep their KV blocks and sit the step out. What the decodes leave is its
prompt tokens, computed a chunk a step.

`fixed_rows` and `prompt_token_rows` are measured on CPU at warm-up (engine.warm_up.shared_step_costs)
unless the deployment sets them; on a GPU, where a step's time barely grows with its batch, they are
not measured and nothing is held back. Without `prompt_token_rows`, a sequence computing or waiting
to start its prompt counts as one row and prompt tokens are not held back. A slowdown of 0 turns
the bound off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from engine.sequence import Sequence


def width(slowdown: float, fixed_rows: float, least: float) -> float:
    """The most rows a shared step may carry (at least `least`, the least demanding tenant's)."""
    return max(least, (slowdown - 1.0) * fixed_rows + slowdown * least)


def tenant_cap(demands: Iterable[float], limit: float) -> float:
    """The largest per-tenant cap q with sum(min(demand, q)) <= limit (water-filling), or the
    largest demand when everything fits."""
    ordered = sorted(demands)
    left, taken = limit, 0.0
    for i, demand in enumerate(ordered):
        tenants_left = len(ordered) - i
        if demand * tenants_left > left:
            return left / tenants_left
        left -= demand
        taken = demand
    return taken


class StepShare:
    """One step's share: the decodes that sit it out, and each tenant's rows left for prompt
    tokens (None: not bounded)."""

    __slots__ = ("_cap", "_rows", "sit_out", "token_rows")

    def __init__(
        self,
        sit_out: set[int] | None = None,
        rows: dict[str, float] | None = None,
        cap: float = 0.0,
        token_rows: float = 1.0,
    ) -> None:
        self.sit_out = sit_out or set()
        self._rows = rows
        self._cap = cap  # a tenant the plan did not see (it had no demand) has the whole cap
        self.token_rows = token_rows

    def allow(self, seq: Sequence, tokens: int) -> int:
        """The prompt tokens of `tokens` that `seq` may compute this step."""
        if self._rows is None:
            return tokens
        left = self._rows.get(seq.tenant, self._cap)
        return max(0, min(tokens, math.floor(left / self.token_rows + 1e-9)))

    def charge(self, seq: Sequence, tokens: int) -> None:
        """`seq` computes `tokens` prompt tokens this step."""
        if self._rows is not None:
            self._rows[seq.tenant] = self._rows.get(seq.tenant, self._cap) - tokens * self.token_rows


# A tenant whose sequences all finished less than this long ago is still present (its client's next
# request is on its way): the step stays as narrow as for a tenant with a single row.
LINGER_S = 0.25


class SharedStepWidth:
    __slots__ = ("_clock", "_seen", "fixed_rows", "prompt_token_rows", "slowdown")

    def __init__(
        self,
        slowdown: float,
        fixed_rows: float | None,
        prompt_token_rows: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slowdown = slowdown
        self.fixed_rows = fixed_rows  # None: not known (not measured yet, or a GPU): no bound
        self.prompt_token_rows = prompt_token_rows  # None: a prompt counts one row, not held back
        self._clock = clock
        self._seen: dict[str, float] = {}  # when each tenant last had unfinished sequences

    @property
    def enabled(self) -> bool:
        return self.slowdown > 0 and self.fixed_rows is not None

    def _present(self, active: Iterable[str]) -> set[str]:
        """The tenants with unfinished sequences, and those that had some within LINGER_S."""
        now = self._clock()
        for tenant in active:
            self._seen[tenant] = now
        for tenant in [t for t, at in self._seen.items() if now - at >= LINGER_S]:
            del self._seen[tenant]
        return set(self._seen)

    def plan(
        self,
        running: Iterable[Sequence],
        startable: Iterable[Sequence],
        active: Iterable[str],
        max_prompt_tokens: int,
    ) -> StepShare:
        """This step's share. `startable`: waiting sequences that may start this step (a slot is
        free); `active`: the tenants with unfinished sequences; `max_prompt_tokens`: the most
        prompt tokens one step computes."""
        if not self.enabled:
            return StepShare()
        assert self.fixed_rows is not None
        present = self._present(active)
        if len(present) < 2:
            return StepShare()
        token_rows = self.prompt_token_rows
        decoding: dict[str, list[Sequence]] = {}
        prompt_tokens: dict[str, int] = {}
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                decoding.setdefault(seq.tenant, []).append(seq)
            else:
                prompt_tokens[seq.tenant] = prompt_tokens.get(seq.tenant, 0) + seq.num_uncomputed_tokens
        starting: set[str] = set()
        for seq in startable:
            if seq.tenant not in starting:  # a tenant's first: the others start after it
                starting.add(seq.tenant)
                prompt_tokens[seq.tenant] = prompt_tokens.get(seq.tenant, 0) + seq.num_uncomputed_tokens
        demand: dict[str, float] = {t: float(len(seqs)) for t, seqs in decoding.items()}
        for tenant, tokens in prompt_tokens.items():
            cost = 1.0 if token_rows is None else token_rows * min(tokens, max_prompt_tokens)
            demand[tenant] = demand.get(tenant, 0.0) + cost
        for tenant in present - demand.keys():  # waiting for a slot or a grammar, or lingering
            demand[tenant] = 1.0
        least = min(demand.values())
        limit = width(self.slowdown, self.fixed_rows, least)
        if sum(demand.values()) <= limit:
            return StepShare()
        cap = max(least, tenant_cap(demand.values(), limit))
        sit_out: set[int] = set()
        rows: dict[str, float] = {}
        for tenant in demand:
            seqs = decoding.get(tenant, [])
            turns = min(len(seqs), math.floor(cap + 1e-9))
            if len(seqs) > turns:
                seqs.sort(key=lambda s: (s.last_decode_step, s.seq_id))  # least recently decoded first
                sit_out.update(s.seq_id for s in seqs[turns:])
            rows[tenant] = cap - turns
        if token_rows is None:
            return StepShare(sit_out)
        return StepShare(sit_out, rows, cap, token_rows)
