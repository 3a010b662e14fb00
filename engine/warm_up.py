"""Warm-up before a replica serves: one forward of each step shape whose kernels are built on first
use, so that no tenant's first request waits for them.

Triton compiles a kernel for each set of compile-time constants it is launched with (the prefill
kernel's row tile follows the step's longest query: 16, 32 or 64 rows; the decode kernel has a
single-pass and a split-KV path) and specializes integer arguments that equal 1 or are multiples
of 16 (the block tables' width). cuBLAS picks and loads its kernels per shape class. Each is paid
once per process, on the first step that needs it. The decode steps that replay CUDA graphs were
compiled when the graphs were captured; this covers the eager steps: prefill chunks from a few
tokens to the step budget, a chunk after a cached prefix mixed with decode rows, and eager decodes
short and longer than the split size.

On CPU the C kernels (attention for prompts and for decodes, the fused norm, rotary and SiLU-mul)
are compiled by the machine's C compiler on their first call, or loaded from the disk cache: a
fresh machine's first request waited 3.4 s for them. One step of each kind (a prompt, a chunk after
a cached prefix mixed with decodes, a decode) builds them all; a CPU kernel serves every shape, so
no more is run.

The steps are synthetic (sequences of token 0, in blocks from the start of the pool, before any
request holds a block); only the forward runs, not the sampler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSequence
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


def synthetic_step(runner: ModelRunner, lengths: list[int], new_tokens: list[int]) -> list[ScheduledSequence]:
    """Sequences of ``lengths`` tokens (all token 0), each with its last ``new_tokens`` to compute
    and the rest taken as cached; their blocks laid out one after another from the pool's start."""
    items, block = [], 0
    for i, (length, new) in enumerate(zip(lengths, new_tokens, strict=True)):
        seq = Sequence(f"warm-up-{i}", [0] * length, SamplingParams(max_tokens=1))
        blocks = -(-length // runner.block_size)
        seq.block_table = list(range(block, block + blocks))
        if runner.num_window_blocks:
            seq.window_block_table = [b % runner.num_window_blocks for b in seq.block_table]
        block += blocks
        seq.num_computed_tokens = length - new
        items.append(ScheduledSequence(seq, new))
    if block > runner.num_blocks:
        raise ValueError(f"the step needs {block} KV blocks, the pool has {runner.num_blocks}")
    return items


def warm_up_shapes(
    max_num_batched_tokens: int, max_model_len: int, block_size: int, *, gpu: bool = True
) -> list[tuple[list[int], list[int]]]:
    """(lengths, new tokens) of each warm-up step, within the step budget and the context length.
    On CPU one step of each kind suffices (a kernel there serves every shape)."""
    budget = min(max_num_batched_tokens, max_model_len)
    shapes: list[tuple[list[int], list[int]]] = []
    chunks = {min(8, budget), min(24, budget), min(64, budget), budget} if gpu else {min(8, budget)}
    for n in sorted(chunks):
        shapes.append(([n], [n]))  # prefill chunks: each row tile, and the widest step
    if max_model_len > 2 * block_size + 40 and budget >= 43:
        # A chunk after a cached prefix, with three decode rows in the same launch.
        prefix, context = min(max_model_len - 40, 600), min(100, max_model_len)
        shapes.append(([prefix + 40, context, context, context], [40, 1, 1, 1]))
    decodes = {min(100, max_model_len), min(1100, max_model_len)} if gpu else {min(100, max_model_len)}
    for context in sorted(decodes):
        shapes.append(([context, context], [1, 1]))  # eager decodes: single pass, split-KV
    return shapes


def warm_up(runner: ModelRunner, max_num_batched_tokens: int, max_model_len: int) -> float:
    """Runs the warm-up steps; returns the seconds it took."""
    started = time.perf_counter()
    gpu = runner.device.type == "cuda"
    shapes = [
        s
        for s in warm_up_shapes(max_num_batched_tokens, max_model_len, runner.block_size, gpu=gpu)
        if sum(-(-n // runner.block_size) for n in s[0]) <= runner.num_blocks
    ]
    for lengths, new in shapes:
        runner.execute(runner.prepare(synthetic_step(runner, lengths, new)))
    if gpu:
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    logger.info("warmed up %d step shapes in %.1f s", len(shapes), seconds)
    return seconds


# The decode steps timed for a step's fixed cost: one sequence and this many (or max_num_seqs);
# and one sequence beside a prompt chunk of this many tokens, for a prompt token's cost.
FIXED_ROWS_PROBE_WIDTH = 32
FIXED_ROWS_PROBE_CONTEXT = 100
PROMPT_PROBE_TOKENS = 32
# Interleaved timings of each; the least of each is kept, since other processes on the machine
# (the web tier starting beside the replica) only ever add time.
FIXED_ROWS_REPEATS = 7


@dataclass(frozen=True, slots=True)
class SharedStepCosts:
    """A step's costs in rows of a decoded sequence's cost (engine.step_width)."""

    fixed_rows: float  # the step's fixed cost (reading the weights)
    prompt_token_rows: float  # one prompt token's


def shared_step_costs(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> SharedStepCosts | None:
    """A step's fixed cost and a prompt token's, in rows of per-sequence decode cost, from the least
    times of steps of 1 and of FIXED_ROWS_PROBE_WIDTH decodes and of one decode beside a
    PROMPT_PROBE_TOKENS-token prompt chunk: with a step of b decodes and p prompt tokens taking
    a + c * b + d * p, returns a / c and d / c. None where it cannot be measured (too few sequences
    or blocks, or on a GPU, where a step's time barely grows with its batch); a step that does not
    grow measurably gives a large fixed cost, and so no bound in practice."""
    if runner.device.type != "cpu":
        return None
    wide = min(FIXED_ROWS_PROBE_WIDTH, max_num_seqs)
    context = min(FIXED_ROWS_PROBE_CONTEXT, max_model_len)
    prompt = min(PROMPT_PROBE_TOKENS, max_model_len)
    blocks = -(-context // runner.block_size)
    if wide < 2 or max(wide * blocks, blocks + -(-prompt // runner.block_size)) > runner.num_blocks:
        return None
    shapes = {
        "one": ([context], [1]),
        "wide": ([context] * wide, [1] * wide),
        "prompt": ([context, prompt], [1, prompt]),
    }
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(FIXED_ROWS_REPEATS):
        for name, (lengths, new) in shapes.items():
            inputs = runner.prepare(synthetic_step(runner, lengths, new))
            started = time.perf_counter()
            runner.execute(inputs)
            times[name].append(time.perf_counter() - started)
    one, many, chunk = (min(times[name]) for name in shapes)
    per_row = (many - one) / (wide - 1)
    if per_row <= 0:
        return SharedStepCosts(64.0 * max_num_seqs, 1.0)
    fixed = one - per_row
    rows = min(max(fixed / per_row, 0.0), 64.0 * max_num_seqs)
    per_token = max((chunk - one) / prompt, 0.0)
    token_rows = min(max(per_token / per_row, 0.01), 64.0)
    logger.info(
        "decode step: %.1f ms fixed, %.2f ms a sequence (%.1f rows), %.2f ms a prompt token (%.2f rows)",
        1e3 * fixed,
        1e3 * per_row,
        rows,
        1e3 * per_token,
        token_rows,
    )
    return SharedStepCosts(rows, token_rows)
