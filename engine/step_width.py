"""How many rows a step may carry while several tenants share the replica.

On a CPU a step's time grows with its rows: reading the weights is a fixed cost, and every
sequence decoded and every prompt token computed adds its own products. A tenant that runs a
hundred sequences, or sends prompt after prompt of a thousand tokens (paid for, token by token),
would otherwise make every step, and so every other tenant's time between tokens, many times
longer: a step that computes a 2,048-token prompt chunk takes over a hundred times a one-sequence
decode step there.

A tenant's demand on a step is its rows. A row is one sequence decoded at ROW_CONTEXT tokens of
context; a decoded sequence costs one row plus `decode_key_rows` per key it attends past
ROW_CONTEXT (a long context's keys are read for it alone). A prompt token costs
`prompt_token_rows`, plus `prompt_key_rows` per key it attends (its position), plus
`prompt_logprob_rows` where its request asked for prompt logprobs (the token is scored over the
vocabulary). A tenant's demand counts its decodes, and the prompt tokens it could compute: for its
prompts being computed and those it has waiting, as many as there are free slots, up to a step's
prompt budget (the tokens a start would compute: those the prefix cache does not already hold). A tenant present without demand (its
sequences wait for a slot, or all finished less than LINGER_S ago: its client's next request is on
its way) counts one row. Where a step would run spare-capacity (`flex`) sequences alone and
such steps are given up when a more important request arrives (engine.step_interrupt), a lingering
tenant does not count: its next request does not wait for the step. While two or more tenants are present, a step carries at most

    width = (slowdown - 1) * fixed_rows + slowdown * least

rows, where `least` is the smallest demand and `fixed_rows` is the step's fixed cost in rows of
per-sequence cost (with a step of b decodes taking a + c * b seconds, fixed_rows = a / c). A step
of that width takes at most `slowdown` times the step the least demanding tenant would run alone.

The rows are shared by one cap per tenant, the largest that keeps the step within the width
(water-filling: tenants demanding less than the cap are never held back, and tenants of equal demand
run together as before). Where even the least demanding tenants do not fit at an equal cap, they
keep their whole demand, and the others share what the width leaves beside them (at least a row
each): the least demanding tenant's prompt then takes one step, as it would alone, rather than
several, and no other tenant matches it row for row. A tenant spends its cap on its decodes
first: above the cap, its sequences take turns, each step decoding those that decoded least
recently, while the others keep their KV blocks and sit the step out. What the decodes leave is its
prompt tokens, computed a chunk a step.

Tiers: the width is set by the tenants of the most important tier present (a tenant counts at its
most important sequence's tier, a lingering one at the tier it was last seen with). Sequences of a
less important tier (`flex`: batch lines, which run on spare capacity) never set the least demand:
the more important tenants keep what the width gives them, and the less important ones share what
it leaves beside them. A batch tenant's few decodes would otherwise narrow the step an interactive
tenant's prompt is computed in, and that prompt would take several steps instead of one.

While everything fits the width, the spare rows are shared alike: no tenant is held back, and
whatever a demand misses (a prompt computed beyond the prefix-cache hits it was counted by) cannot
widen the step past the width.

The costs are measured on CPU at warm-up (engine.warm_up.shared_step_costs) unless the deployment
sets them; on a GPU, where a step's time barely grows with its batch, they are not measured and
nothing is held back. Without `prompt_token_rows`, a sequence computing or waiting to start its
prompt counts as one row and prompt tokens are not held back. A slowdown of 0 turns the bound off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from engine.rules import SPARE_CAPACITY_PRIORITY
from engine.sequence import Sequence

K = TypeVar("K")


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


def tenant_caps(demand: dict[K, float], limit: float) -> dict[K, float]:
    """Each tenant's rows for a step of at most `limit` (assumed short of the total demand): one
    water-filled cap for all; or, where that cap falls short of the least demand, the least
    demanding tenants' whole demand, and for the others an equal share of what is left (each
    demands more than the least, so no less than that share), at least one row each."""
    cap = tenant_cap(demand.values(), limit)
    least = min(demand.values())
    if cap >= least - 1e-9:
        return dict.fromkeys(demand, cap)
    lightest = [t for t, d in demand.items() if d <= least + 1e-9]
    others = {t: d for t, d in demand.items() if d > least + 1e-9}
    caps = dict.fromkeys(lightest, least)
    if others:
        left = limit - least * len(lightest)
        caps.update(dict.fromkeys(others, max(1.0, left / len(others))))
    return caps


# A tenant's sequences of the most important tier present, or (True) of a less important one.
Group = tuple[str, bool]

# The most important tier (engine.rules.SERVICE_TIER_PRIORITY counts up from it).
MOST_IMPORTANT = 0


def group(seq: Sequence, top: int) -> Group:
    return (seq.tenant, seq.priority > top)


# A row is one sequence decoded at this many tokens of context (the warm-up probe's).
ROW_CONTEXT = 100


@dataclass(frozen=True, slots=True)
class RowCosts:
    """What a step's parts cost, in rows (see the module's docstring)."""

    token: float = 1.0  # a prompt token
    key: float = 0.0  # a decoded sequence's key past ROW_CONTEXT
    prompt_key: float = 0.0  # a key a prompt token attends
    logprob: float = 0.0  # a prompt token scored for prompt logprobs

    def decode(self, seq: Sequence) -> float:
        return 1.0 + self.key * max(0, seq.num_computed_tokens + 1 - ROW_CONTEXT)

    def _terms(self, seq: Sequence, start: int) -> tuple[float, float]:
        """(b, a) with the cost of t prompt tokens from `start` = b t + a t^2."""
        per_token = self.token + (self.logprob if seq.wants_prompt_logprobs else 0.0)
        # The token at position p attends p + 1 keys: t tokens from start attend
        # t (start + 1) + t (t - 1) / 2 keys.
        half = self.prompt_key / 2
        return per_token + self.prompt_key * (start + 1) - half, half

    def prompt(self, seq: Sequence, start: int, tokens: int) -> float:
        b, a = self._terms(seq, start)
        return b * tokens + a * tokens * tokens

    def prompt_tokens(self, seq: Sequence, start: int, rows: float, tokens: int) -> int:
        """The most prompt tokens, up to `tokens`, that `rows` pay for from `start`."""
        if rows <= 0:
            return 0
        b, a = self._terms(seq, start)
        t = rows / b if a == 0 else (math.sqrt(b * b + 4 * a * rows) - b) / (2 * a)
        fit = min(tokens, math.floor(t + 1e-9))
        while fit > 0 and self.prompt(seq, start, fit) > rows + 1e-9:  # rounding
            fit -= 1
        return max(0, fit)


class StepShare:
    """One step's share: the decodes that sit it out, and each tenant's rows left for prompt
    tokens (None: not bounded)."""

    __slots__ = ("_cap", "_rows", "_top", "costs", "sit_out")

    def __init__(
        self,
        sit_out: set[int] | None = None,
        rows: dict[Group, float] | None = None,
        cap: float = 0.0,
        costs: RowCosts | None = None,
        top: int = MOST_IMPORTANT,
    ) -> None:
        self.sit_out = sit_out or set()
        self._rows = rows
        self._cap = cap  # a tenant the plan did not see (it had no demand)
        self.costs = costs or RowCosts()
        self._top = top  # the most important tier present

    @property
    def bounded(self) -> bool:
        """Whether this step's prompt tokens are shared out (each tenant's rows are bounded)."""
        return self._rows is not None

    def allow(self, seq: Sequence, tokens: int, start: int | None = None) -> int:
        """The prompt tokens of `tokens` that `seq` may compute this step, from `start` (by default
        its computed tokens)."""
        if self._rows is None:
            return tokens
        left = self._rows.get(group(seq, self._top), self._cap)
        at = seq.num_computed_tokens if start is None else start
        return self.costs.prompt_tokens(seq, at, left, tokens)

    def charge(self, seq: Sequence, tokens: int, start: int | None = None) -> None:
        """`seq` computes `tokens` prompt tokens this step, from `start` (by default its computed
        tokens)."""
        if self._rows is not None:
            at = seq.num_computed_tokens if start is None else start
            cost = self.costs.prompt(seq, at, tokens)
            key = group(seq, self._top)
            self._rows[key] = self._rows.get(key, self._cap) - cost


# A tenant whose sequences all finished less than this long ago is still present (its client's next
# request is on its way): the step stays as narrow as for a tenant with a single row.
LINGER_S = 0.25
# How long after a more important sequence last ran or waited a step of spare-capacity sequences
# alone stays cut to a decode step's worth of prompt tokens (SharedStepWidth.spare_prompt_tokens):
# a batch alone on its replica computes its prompts in whole steps, which is faster.
SPARE_CUT_S = 60.0


class SharedStepWidth:
    __slots__ = (
        "_clock",
        "_seen",
        "_important_at",
        "fixed_rows",
        "decode_key_rows",
        "prompt_key_rows",
        "prompt_logprob_rows",
        "prompt_token_rows",
        "slowdown",
        "spare_steps_interruptible",
    )

    def __init__(
        self,
        slowdown: float,
        fixed_rows: float | None,
        prompt_token_rows: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        decode_key_rows: float | None = None,
        prompt_key_rows: float | None = None,
        prompt_logprob_rows: float | None = None,
    ) -> None:
        self.slowdown = slowdown
        self.fixed_rows = fixed_rows  # None: not known (not measured yet, or a GPU): no bound
        self.prompt_token_rows = prompt_token_rows  # None: a prompt counts one row, not held back
        self.decode_key_rows = decode_key_rows  # None: not known, a decode is one row at any context
        self.prompt_key_rows = prompt_key_rows  # None: not known, 0
        self.prompt_logprob_rows = prompt_logprob_rows  # None: not known, 0
        self._clock = clock
        # Whether a step of spare-capacity sequences alone is given up when a more important
        # request arrives (engine.step_interrupt; the replica's worker sets it).
        self.spare_steps_interruptible = False
        # When each tenant last had unfinished sequences, and its most important tier then.
        self._seen: dict[str, tuple[float, int]] = {}
        # When a sequence more important than the spare-capacity tier last ran or waited to start.
        self._important_at: float | None = None

    @property
    def enabled(self) -> bool:
        return self.slowdown > 0 and self.fixed_rows is not None

    def spare_prompt_tokens(
        self, running: Iterable[Sequence], first_waiting: Sequence | None, max_num_seqs: int
    ) -> int | None:
        """The most prompt tokens a step of spare-capacity sequences alone computes, or None (no cap).

        Such a step is given up between layers when a more important request arrives
        (engine.step_interrupt), and a request arriving during it waits for the layer under way: a
        step that computes a wave of batch prompts at once (32 of 64 tokens: 2,000 tokens, ten times
        a full decode step) made that wait most of a decode step's time. So its prompt tokens cost at
        most a full decode step's rows (`max_num_seqs`, at the measured rows of a prompt token): the
        wait stays within a layer of a step at most about twice the widest decode step, and the
        batch's prompts are computed a chunk a step beside its decodes instead of in one long step.
        None where such steps are not given up, the costs are not measured (on a GPU), a more
        important sequence runs or waits to start, or none has for SPARE_CUT_S: a batch alone on
        its replica computes its prompts in whole steps (cut, 1.4x slower on a 2-core CPU)."""
        if not self.spare_steps_interruptible or self.prompt_token_rows is None or self.fixed_rows is None:
            return None
        if (first_waiting is not None and first_waiting.priority < SPARE_CAPACITY_PRIORITY) or any(
            seq.priority < SPARE_CAPACITY_PRIORITY for seq in running
        ):
            self._important_at = self._clock()
            return None
        if self._important_at is None or self._clock() - self._important_at >= SPARE_CUT_S:
            return None  # no more important traffic lately: the batch's prompts go in whole steps
        return max(1, math.floor(max_num_seqs / self.prompt_token_rows))

    def costs(self) -> RowCosts:
        return RowCosts(
            self.prompt_token_rows or 1.0,
            self.decode_key_rows or 0.0,
            self.prompt_key_rows or 0.0,
            self.prompt_logprob_rows or 0.0,
        )

    def _present(self, active: Iterable[str], tiers: dict[str, int]) -> dict[str, int]:
        """The tenants with unfinished sequences, and those that had some within LINGER_S, each
        with its most important tier: of its sequences this step (`tiers`), else the one it was
        last seen with (the most important tier where never seen)."""
        now = self._clock()
        for tenant in active:
            _, tier = self._seen.get(tenant, (now, MOST_IMPORTANT))
            self._seen[tenant] = (now, tiers.get(tenant, tier))
        for tenant in [t for t, (at, _) in self._seen.items() if now - at >= LINGER_S]:
            del self._seen[tenant]
        return {t: tier for t, (_, tier) in self._seen.items()}

    def plan(
        self,
        running: Iterable[Sequence],
        startable: Iterable[Sequence],
        active: Iterable[str],
        max_prompt_tokens: int,
        prompt_start: Callable[[Sequence], int] | None = None,
    ) -> StepShare:
        """This step's share. `startable`: waiting sequences that may start this step, in each
        tenant's order (at most as many of a tenant's as there are free slots); `active`: the tenants with unfinished sequences; `max_prompt_tokens`: the most
        prompt tokens one step computes; `prompt_start`: where a waiting sequence's start would
        begin computing (after the prefix-cache hits it would claim; None: at its computed tokens)."""
        if not self.enabled:
            return StepShare()
        assert self.fixed_rows is not None
        running, startable = list(running), list(startable)
        tiers: dict[str, int] = {}
        for seq in (*running, *startable):
            tiers[seq.tenant] = min(seq.priority, tiers.get(seq.tenant, seq.priority))
        active = set(active)
        present = self._present(active, tiers)
        if self.spare_steps_interruptible and tiers and min(tiers.values()) >= SPARE_CAPACITY_PRIORITY:
            # Only spare-capacity sequences would run, and such a step is given up when a more
            # important request arrives: a lingering tenant's next request needs no narrow step.
            present = {t: tier for t, tier in present.items() if t in active}
        if len(present) < 2:
            return StepShare()
        top = min(present.values())
        costs = self.costs()
        priced = self.prompt_token_rows is not None
        decoding: dict[Group, list[Sequence]] = {}
        prompts: dict[Group, list[tuple[Sequence, int]]] = {}  # (sequence, where its next chunk starts)
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                decoding.setdefault(group(seq, top), []).append(seq)
            else:
                prompts.setdefault(group(seq, top), []).append((seq, seq.num_computed_tokens))
        # A tenant's waiting sequences count up to the step's prompt budget (beyond it they could
        # not start this step anyway); the caller gives at most as many as there are free slots.
        waiting_tokens: dict[Group, int] = {}
        for seq in startable:
            key = group(seq, top)
            if waiting_tokens.get(key, 0) >= max_prompt_tokens:
                continue
            start = seq.num_computed_tokens if prompt_start is None else prompt_start(seq)
            waiting_tokens[key] = waiting_tokens.get(key, 0) + seq.num_tokens - start
            prompts.setdefault(key, []).append((seq, start))
        demand: dict[Group, float] = {g: sum(costs.decode(s) for s in seqs) for g, seqs in decoding.items()}
        for key, chunks in prompts.items():
            cost, budget = 0.0, max_prompt_tokens
            for seq, start in chunks if priced else ():
                tokens = min(seq.num_tokens - start, budget)
                if tokens <= 0:
                    break
                budget -= tokens
                cost += costs.prompt(seq, start, tokens)
            demand[key] = demand.get(key, 0.0) + (cost if priced else 1.0)
        # Present without demand (waiting for a slot or a grammar, or lingering): one row, in the
        # tier it was last seen with.
        with_demand = {tenant for tenant, _ in demand}
        for tenant, tier in present.items():
            if tenant not in with_demand:
                demand[(tenant, tier > top)] = 1.0
        leading = {g: d for g, d in demand.items() if not g[1]}
        spare_tier = {g: d for g, d in demand.items() if g[1]}
        least = min((leading or demand).values())
        limit = width(self.slowdown, self.fixed_rows, least)
        total = sum(demand.values())
        if total <= limit:
            # Everything fits; the spare rows are shared alike, so that what a demand misses cannot
            # widen the step past the width.
            caps = {g: d + (limit - total) / len(demand) for g, d in demand.items()}
        else:
            leading_total = sum(leading.values())
            if leading_total >= limit:
                caps = tenant_caps(leading, limit)
                caps.update(dict.fromkeys(spare_tier, 0.0))
            else:
                # The most important tier keeps its whole demand; the less important ones share
                # what the width leaves beside it.
                caps = dict(leading)
                caps.update(dict.fromkeys(spare_tier, tenant_cap(spare_tier.values(), limit - leading_total)))
        sit_out: set[int] = set()
        rows: dict[Group, float] = {}
        for key, cap in caps.items():
            seqs = decoding.get(key, [])
            seqs.sort(key=lambda s: (s.last_decode_step, s.seq_id))  # least recently decoded first
            spent, turns = 0.0, 0
            for seq in seqs:  # each tenant decodes at least one sequence a step
                cost = costs.decode(seq)
                if turns and spent + cost > cap + 1e-9:
                    break
                spent += cost
                turns += 1
            sit_out.update(s.seq_id for s in seqs[turns:])
            rows[key] = max(0.0, cap - spent)
        if not priced:
            return StepShare(sit_out)
        return StepShare(sit_out, rows, least, costs, top)
