"""A sparse mixture of experts in place of a decoder layer's MLP (Mixtral, Qwen3-MoE).

A router scores every expert for each token; the token goes to its top k, whose outputs are summed
weighted by their router probabilities (renormalised over the chosen k where the model says so).
The experts run grouped: the (token, expert) pairs are sorted by expert, so each expert multiplies
one contiguous block of the tokens routed to it, and experts no token chose cost nothing. A dense
reference (every expert over every token, masked) is kept beside it for the tests. On CPU each
expert is one multiply (oneDNN-packed weights where its block is wide enough); on a GPU one Triton
grouped GEMM per projection covers every expert (kernels.moe_grouped_gemm) where the experts are
small, and large ones are one cuBLAS multiply each (`KERNEL_MAX_EXPERT_WEIGHTS`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # (tokens, top_k) weights in float32, (tokens, top_k) expert ids
    """Softmax over the experts in float32, then the top k; their weights renormalised to sum to
    one with `renormalize` (Mixtral always, Qwen3-MoE by norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.intermediate_size = cfg.moe_intermediate_size
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # Each expert's gate|up projection (num_experts, 2 * intermediate, hidden) and its down
        # projection (num_experts, hidden, intermediate), as nn.Linear lays weights out.
        inter = cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, inter))
        self.fused: ModuleType | None = None  # the fused kernels' silu_mul (set by LlamaForCausalLM)
        # oneDNN-packed copies of each expert's weights on CPU (engine.models.loader), or None.
        self.packed_w13: list[torch.Tensor] | None = None
        self.packed_w2: list[torch.Tensor] | None = None
        # The Triton grouped GEMM (kernels.moe_grouped_gemm): None, on a GPU where the experts
        # are small (`kernel_suits`); tests force it either way.
        self.use_kernel: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return self.grouped(x, weights, experts)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    # Below this many rows oneDNN's packed weights lose to a plain multiply (measured on the bench
    # model's experts: 1-2 rows about 20% slower, from 4 rows 30-60% faster).
    PACKED_MIN_ROWS = 4

    def _linear(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        packed = self.packed_w13 if which == "w13" else self.packed_w2
        if packed is not None and x.shape[0] >= self.PACKED_MIN_ROWS:
            from engine.models.llama import packed_linear

            return packed_linear(x, packed[expert], None)
        return F.linear(x, (self.w13 if which == "w13" else self.w2)[expert])

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each token, the (token, expert) pairs sorted by expert so
        that each expert runs once over a contiguous block of its tokens."""
        tokens = x.shape[0]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # pair indices (token * top_k + slot), grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        rows = x.index_select(0, token_of)  # (tokens * top_k, hidden), expert by expert
        if self.use_kernel if self.use_kernel is not None else x.is_cuda and self.kernel_suits():
            from kernels.moe_grouped_gemm import moe_grouped_gemm

            # One launch per projection for all the experts.
            out_rows = moe_grouped_gemm(self._act(moe_grouped_gemm(rows, self.w13, counts)), self.w2, counts)
        else:
            out_rows = self._per_expert(rows, counts)
        # Weighted in float32 as the reference implementations weight, then summed per token in the
        # order of its slots.
        scaled = out_rows.float() * weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, scaled)
        return out.to(x.dtype)

    # Above this many weights in an expert's gate|up projection, one cuBLAS multiply per expert
    # beats the grouped kernel on a GPU. Measured on an H100 in bfloat16 (bench/moe_experts.py):
    # the whole block of Mixtral-8x7B's shape (117M) ran 1.0-1.8x faster as a loop at batches of
    # 1-1,024 tokens, and its gate|up projection 1.1-1.4x faster than under the best of nine tile
    # settings; the bench model's experts (1.4M) ran 1.5-1.6x faster grouped from 8 tokens up,
    # where a loop's launches dominate. Qwen3-30B-A3B's experts (3.1M) are of the second kind.
    KERNEL_MAX_EXPERT_WEIGHTS = 16 * 2**20

    def kernel_suits(self) -> bool:
        return self.w13[0].numel() <= self.KERNEL_MAX_EXPERT_WEIGHTS

    def _per_expert(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's block of rows through it, one multiply per projection and expert."""
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            hidden = self._act(self._linear(rows[start:end], expert, "w13"))
            out_rows[start:end] = self._linear(hidden, expert, "w2")
            start = end
        return out_rows

    def dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The reference: every expert over every token, each output kept where the token chose
        that expert. Slower by num_experts / top_k; for tests and the benchmark."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for expert in range(self.num_experts):
            hidden = F.silu(F.linear(x, self.w13[expert][: self.intermediate_size]))
            hidden = hidden * F.linear(x, self.w13[expert][self.intermediate_size :])
            y = F.linear(hidden, self.w2[expert]).float()
            weight = (weights * (experts == expert)).sum(dim=-1)  # zero where not chosen
            out += y * weight[:, None]
        return out.to(x.dtype)
