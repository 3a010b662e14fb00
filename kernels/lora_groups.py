"""Group a batch's tokens by LoRA slot, the layout the shrink and expand kernels read.

Punica's segmented gather (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024) and
S-LoRA (Sheng et al., 2023) batch many adapters in one launch by visiting each adapter's tokens as
one contiguous group. Built once per step with device ops only (no host sync, so it can sit inside
a CUDA graph) and shared by every LoRA layer of that step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._launch import check_int


class LoraTokenGroups(NamedTuple):
    sorted_token_ids: torch.Tensor  # (num_tokens,) int32: token rows ordered by slot, base-model rows first
    num_tokens_per_slot: torch.Tensor  # (num_slots,) int32
    slot_start: torch.Tensor  # (num_slots,) int32: where each slot's group begins in sorted_token_ids


def lora_token_groups(slot_indices: torch.Tensor, num_slots: int) -> LoraTokenGroups:
    """Sort token rows by slot; rows with slot -1 (no LoRA) sort first and belong to no group."""
    check_int("slot_indices", slot_indices)
    if slot_indices.dim() != 1:
        raise ValueError(f"slot_indices must be (num_tokens,), got {tuple(slot_indices.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    shifted = slot_indices.to(torch.int64) + 1  # bucket 0 holds the base-model rows
    sorted_token_ids = torch.argsort(shifted, stable=True).to(torch.int32)
    # scatter_add rather than bincount: bincount syncs with the host to size its output.
    # An out-of-range slot fails here (index error on CPU, device assert on GPU).
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slot_indices.device)
    counts.scatter_add_(0, shifted, torch.ones_like(shifted))
    starts = torch.cumsum(counts, 0) - counts  # exclusive prefix sum
    return LoraTokenGroups(sorted_token_ids, counts[1:].to(torch.int32), starts[1:].to(torch.int32))
