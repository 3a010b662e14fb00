"""Which adapter holds which device slot: the scheduler admits through this table, the manager loads
what it says into the slots before the step's forward.

An adapter keeps its slot while any running sequence uses it. A slot changes hands only when a
waiting sequence needs an adapter that is not resident: first an empty slot, else the slot least
recently used by a step whose adapter no running sequence uses.
"""

from __future__ import annotations


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        assert max_loras >= 1
        self.slots: list[int | None] = [None] * max_loras  # lora_id per slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def max_loras(self) -> int:
        return len(self.slots)

    def slot_of(self, lora_id: int) -> int | None:
        try:
            return self.slots.index(lora_id)
        except ValueError:
            return None

    def can_admit(self, lora_id: int, in_use: set[int]) -> bool:
        """Whether a sequence of this adapter may join the running ones (which use ``in_use``)."""
        return lora_id == 0 or lora_id in in_use or len(in_use) < self.max_loras

    def acquire(self, lora_id: int, in_use: set[int]) -> int:
        """The slot of ``lora_id``, assigning one (possibly evicting an idle adapter) if needed."""
        assert lora_id != 0 and self.can_admit(lora_id, in_use)
        slot = self.slot_of(lora_id)
        if slot is None:
            idle = [i for i, held in enumerate(self.slots) if held is None or held not in in_use]
            # can_admit guarantees one: fewer distinct adapters run than there are slots.
            slot = min(idle, key=lambda i: (self.slots[i] is not None, self._last_used[i]))
            if self.slots[slot] is not None:
                self.num_evictions += 1
            self.slots[slot] = lora_id
            self.num_loads += 1
        self.touch(slot)
        return slot

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock

    def forget(self, lora_id: int) -> None:
        """Drop an adapter that no sequence can use any more (its host copy is gone)."""
        slot = self.slot_of(lora_id)
        if slot is not None:
            self.slots[slot] = None
