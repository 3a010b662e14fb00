"""How many decodes a step may carry while several tenants share the replica.

On a CPU a decode step's time grows with its rows: reading the weights is a fixed cost, and every
sequence adds its own products. A tenant that runs a hundred sequences (paid for, token by token)
would otherwise make every step, and so every other tenant's time between tokens, several times
longer. While two or more tenants have unfinished sequences, a step therefore decodes at most

    width = (slowdown - 1) * fixed_rows + slowdown * fewest

sequences, where `fewest` is the smallest tenant's number of sequences and `fixed_rows` is the
step's fixed cost in rows of per-sequence cost (with a step of b decodes taking a + c * b seconds,
fixed_rows = a / c). A step of that width takes at most `slowdown` times the step the smallest
tenant would run alone.

The rows are shared by one cap per tenant, the largest that keeps the step within the width, and
never below `fewest` (so tenants as wide as the smallest one are never held back, and tenants of
equal size run together as before). The sequences of a tenant above the cap take turns: each step
decodes those that decoded least recently; the others keep their KV blocks and sit the step out.
Prompt tokens are not counted here: a prompt chunk costs a fraction of a decode row on a CPU (its
products are one matrix product), and max_prefill_tokens_with_decodes bounds them.

`fixed_rows` is measured on CPU at warm-up (engine.warm_up.decode_fixed_rows) unless the
deployment sets it; on a GPU, where a step's time barely grows with its batch, it is not measured
and nothing is held back. A slowdown of 0 turns the bound off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from engine.sequence import Sequence


def width(slowdown: float, fixed_rows: float, fewest: int) -> int:
    """The most decodes a shared step may carry (at least `fewest`, the smallest tenant's)."""
    return max(fewest, math.floor((slowdown - 1.0) * fixed_rows + slowdown * fewest))


def tenant_cap(counts: Iterable[int], limit: int) -> int:
    """The largest per-tenant cap q with sum(min(count, q)) <= limit (water-filling), or the
    largest count when everything fits."""
    ordered = sorted(counts)
    left, taken = limit, 0
    for i, count in enumerate(ordered):
        tenants_left = len(ordered) - i
        if count * tenants_left > left:
            return left // tenants_left
        left -= count
        taken = count
    return taken


class SharedStepWidth:
    __slots__ = ("fixed_rows", "slowdown")

    def __init__(self, slowdown: float, fixed_rows: float | None) -> None:
        self.slowdown = slowdown
        self.fixed_rows = fixed_rows  # None: not known (not measured yet, or a GPU): no bound

    @property
    def enabled(self) -> bool:
        return self.slowdown > 0 and self.fixed_rows is not None

    def sit_out(self, running: Iterable[Sequence], active: Mapping[str, int]) -> set[int]:
        """The seq_ids of running decodes that sit this step out. `active`: unfinished sequences
        per tenant (running, waiting or held)."""
        if not self.enabled or len(active) < 2:
            return set()
        assert self.fixed_rows is not None
        decoding: dict[str, list[Sequence]] = {}
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                decoding.setdefault(seq.tenant, []).append(seq)
        fewest = min(active.values())
        limit = width(self.slowdown, self.fixed_rows, fewest)
        if sum(len(seqs) for seqs in decoding.values()) <= limit:
            return set()
        cap = max(fewest, tenant_cap((len(seqs) for seqs in decoding.values()), limit))
        out: set[int] = set()
        for seqs in decoding.values():
            if len(seqs) > cap:
                seqs.sort(key=lambda s: (s.last_decode_step, s.seq_id))  # least recently decoded first
                out.update(s.seq_id for s in seqs[cap:])
        return out
