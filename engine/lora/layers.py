"""Batched LoRA on the model's fused linears: y = base(x) + B[slot] @ A[slot] @ x, each token its own slot.

A fused linear (q|k|v, gate|up) stands for several PEFT target modules, so one shrink projects the
input onto every sub-module's rank at once and each sub-module's B adds into its own columns.

Two ways to run the same arithmetic, chosen per engine:
- kernels (CUDA): every slot padded to max_lora_rank in one stacked tensor; the Punica-style Triton
  shrink/expand visit each slot's tokens, grouped once per step (kernels.lora_groups).
- torch (CPU): the runner lays the batch out grouped by adapter, so each slot's tokens are one
  contiguous run multiplied by that adapter's own rank only; a step rarely holds more than a few
  adapters, so two small matmuls per adapter beat padded or gathered work.
The scaling is folded into B at load time (engine.lora.loader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from kernels.lora_groups import LoraTokenGroups

Pair = tuple[torch.Tensor, torch.Tensor]  # A (rank, in_features), B (out_features, rank)


@dataclass(slots=True)
class LoRAStep:
    """One step's token-to-slot mapping, shared by every LoRA layer of the forward."""

    token_slots: torch.Tensor  # (num_tokens,) int32 on the device, -1 = base model
    groups: LoraTokenGroups | None = None  # on the kernel path
    # (slot, first row, end row): the batch is laid out so that each adapter's rows are contiguous.
    segments: list[tuple[int, int, int]] = field(default_factory=list)


class LoRAContext:
    """Holder of the current step, read by every LoRALinear; None while no token uses an adapter."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """A base nn.Linear plus the slots' low-rank updates for the sub-modules it fuses."""

    def __init__(
        self,
        base: nn.Linear,
        out_sizes: tuple[int, ...],
        context: LoRAContext,
        *,
        max_loras: int,
        max_rank: int,
        use_kernels: bool,
    ) -> None:
        super().__init__()
        assert sum(out_sizes) == base.out_features
        self.base = base
        self.out_sizes = out_sizes
        self.context = context
        self.use_kernels = use_kernels
        self.max_rank = max_rank
        dev, dtype = base.weight.device, base.weight.dtype
        n = len(out_sizes)
        if use_kernels:
            # (num_slots, n * max_rank, in_features) and per sub-module (num_slots, out_j, max_rank)
            self.lora_a = torch.zeros(max_loras, n * max_rank, base.in_features, device=dev, dtype=dtype)
            self.lora_b = [torch.zeros(max_loras, o, max_rank, device=dev, dtype=dtype) for o in out_sizes]
        # Torch path, per slot: A of every sub-module stacked (n * r, in) and a block-diagonal B^T
        # (n * r, out_features), so two matmuls over the slot's contiguous rows serve the slot.
        self.slot_a: list[torch.Tensor | None] = [None] * max_loras
        self.slot_bt: list[torch.Tensor | None] = [None] * max_loras

    # The base layer's parameters stay reachable under their usual names.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_slot(self, slot: int, pairs: list[Pair | None], rank: int) -> None:
        """Put one adapter's sub-module weights (None: not targeted) into a slot."""
        assert len(pairs) == len(self.out_sizes) and rank <= self.max_rank
        dev, dtype = self.base.weight.device, self.base.weight.dtype
        if self.use_kernels:
            R = self.max_rank
            self.lora_a[slot].zero_()
            for j, pair in enumerate(pairs):
                self.lora_b[j][slot].zero_()
                if pair is not None:
                    a, b = pair
                    self.lora_a[slot, j * R : j * R + rank].copy_(a, non_blocking=True)
                    self.lora_b[j][slot, :, :rank].copy_(b, non_blocking=True)
            return
        n = len(self.out_sizes)
        a_all = torch.zeros(n * rank, self.base.in_features, device=dev, dtype=dtype)
        bt_all = torch.zeros(n * rank, self.base.out_features, device=dev, dtype=dtype)
        col = 0
        for j, (pair, out) in enumerate(zip(pairs, self.out_sizes, strict=True)):
            if pair is not None:
                a, b = pair
                a_all[j * rank : (j + 1) * rank] = a
                bt_all[j * rank : (j + 1) * rank, col : col + out] = b.t()
            col += out
        self.slot_a[slot], self.slot_bt[slot] = a_all, bt_all

    def clear_slot(self, slot: int) -> None:
        if self.use_kernels:
            self.lora_a[slot].zero_()
            for b in self.lora_b:
                b[slot].zero_()
        self.slot_a[slot] = self.slot_bt[slot] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None:
            return y
        if self.use_kernels:
            return self._apply_kernels(x, y, step)
        for slot, start, end in step.segments:
            a, bt = self.slot_a[slot], self.slot_bt[slot]
            assert a is not None and bt is not None, f"slot {slot} is used but holds no adapter"
            y[start:end].addmm_(x[start:end] @ a.t(), bt)
        return y

    def _apply_kernels(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        from kernels.lora_expand import lora_expand
        from kernels.lora_shrink import lora_shrink

        R = self.max_rank
        s = lora_shrink(x.contiguous(), self.lora_a, step.token_slots, 1.0, groups=step.groups)  # (T, n * R)
        col = 0
        for j, out in enumerate(self.out_sizes):
            lora_expand(
                y[:, col : col + out],
                s[:, j * R : (j + 1) * R],
                self.lora_b[j],
                step.token_slots,
                groups=step.groups,
            )
            col += out
        return y
