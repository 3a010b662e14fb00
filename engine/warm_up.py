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
from engine.step_width import ROW_CONTEXT

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


# The steps timed for a step's costs (engine.step_width): one decode and this many (or
# max_num_seqs), at ROW_CONTEXT; one decode beside a prompt chunk of PROMPT_PROBE_TOKENS, and of
# NARROW_PROBE_TOKENS (a narrow step, whose prompt rows take the one-call decode layers), the narrow
# one also after LONG_PROBE_CONTEXT cached tokens and the wide one scoring prompt logprobs;
# LONG_PROBE_SEQS decodes at ROW_CONTEXT and at LONG_PROBE_CONTEXT more.
FIXED_ROWS_PROBE_WIDTH = 32
PROMPT_PROBE_TOKENS = 32
NARROW_PROBE_TOKENS = 8
LONG_PROBE_CONTEXT = 1000
LONG_PROBE_SEQS = 8
PROMPT_LOGPROBS_PROBE = 20
# Interleaved timings of each; the least of each is kept, since other processes on the machine
# (the web tier starting beside the replica) only ever add time.
FIXED_ROWS_REPEATS = 5
# The most any cost may be, in rows (a step that does not grow measurably gives huge ones).
MAX_TOKEN_ROWS = 64.0


@dataclass(frozen=True, slots=True)
class SharedStepCosts:
    """A step's costs in rows of a decoded sequence's cost (engine.step_width); the key and
    logprob costs are None where the pool is too small to measure them."""

    fixed_rows: float  # the step's fixed cost (reading the weights)
    prompt_token_rows: float  # one prompt token's
    decode_key_rows: float | None = None  # a decoded sequence's key past ROW_CONTEXT
    prompt_key_rows: float | None = None  # a key a prompt token attends
    prompt_logprob_rows: float | None = None  # a prompt token scored for prompt logprobs


def _blocks(runner: ModelRunner, lengths: list[int]) -> int:
    return sum(-(-n // runner.block_size) for n in lengths)


def shared_step_costs(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> SharedStepCosts | None:
    """A step's costs in rows of per-sequence decode cost, from the least times of the probe steps:
    with a step of b decodes and p prompt tokens taking a + c * b + d * p, the fixed rows a / c and
    a prompt token's d / c (the larger of a wide chunk's and a narrow one's); and what a long
    context's keys and prompt logprobs add, over c. None where it cannot be measured (too few
    sequences or blocks, or on a GPU, where a step's time barely grows with its batch); a step that
    does not grow measurably gives a large fixed cost, and so no bound in practice."""
    if runner.device.type != "cpu":
        return None
    wide = min(FIXED_ROWS_PROBE_WIDTH, max_num_seqs)
    context = min(ROW_CONTEXT, max_model_len)
    prompt = min(PROMPT_PROBE_TOKENS, max_model_len)
    narrow = min(NARROW_PROBE_TOKENS, prompt)
    if (
        wide < 2
        or max(_blocks(runner, [context] * wide), _blocks(runner, [context, prompt])) > runner.num_blocks
    ):
        return None
    shapes: dict[str, tuple[list[int], list[int], int | None]] = {
        "one": ([context], [1], None),
        "wide": ([context] * wide, [1] * wide, None),
        "prompt": ([context, prompt], [1, prompt], None),
        "narrow": ([context, narrow], [1, narrow], None),
        "logprobs": ([context, prompt], [1, prompt], PROMPT_LOGPROBS_PROBE),
    }
    long = context + LONG_PROBE_CONTEXT
    seqs = min(LONG_PROBE_SEQS, max_num_seqs)
    measure_keys = long <= max_model_len and _blocks(runner, [long] * seqs) <= runner.num_blocks
    if measure_keys:
        shapes["short"] = ([context] * seqs, [1] * seqs, None)
        shapes["long"] = ([long] * seqs, [1] * seqs, None)
        shapes["late"] = ([context, long + narrow], [1, narrow], None)
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(FIXED_ROWS_REPEATS):
        for name, (lengths, new, logprobs) in shapes.items():
            step = synthetic_step(runner, lengths, new)
            if logprobs is not None:
                step[-1].seq.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=logprobs)
            inputs = runner.prepare(step)
            started = time.perf_counter()
            runner.execute(inputs)
            times[name].append(time.perf_counter() - started)
    least = {name: min(t) for name, t in times.items()}
    one = least["one"]
    per_row = (least["wide"] - one) / (wide - 1)
    if per_row <= 0:
        return SharedStepCosts(64.0 * max_num_seqs, 1.0)

    def rows(seconds: float, count: int) -> float:
        return min(max(seconds / count / per_row, 0.0), MAX_TOKEN_ROWS)

    fixed = one - per_row
    fixed_rows = min(max(fixed / per_row, 0.0), 64.0 * max_num_seqs)
    token_rows = max(rows(least["prompt"] - one, prompt), rows(least["narrow"] - one, narrow), 0.01)
    # The probe's prompt is scored at every position but its last.
    logprob_rows = rows(least["logprobs"] - least["prompt"], max(prompt - 1, 1))
    key_rows = prompt_key_rows = None
    if measure_keys:
        key_rows = rows(least["long"] - least["short"], seqs * LONG_PROBE_CONTEXT)
        # Each narrow prompt token attends `long` more keys in the late chunk.
        prompt_key_rows = rows(least["late"] - least["narrow"], narrow * long)
    logger.info(
        "step costs: %.1f ms fixed, %.2f ms a sequence (%.1f rows); in rows: %.2f a prompt token,"
        " %.2f a scored prompt token, %s a decode's 1,000 keys, %s a prompt token's",
        1e3 * fixed,
        1e3 * per_row,
        fixed_rows,
        token_rows,
        logprob_rows,
        "?" if key_rows is None else f"{1000 * key_rows:.2f}",
        "?" if prompt_key_rows is None else f"{1000 * prompt_key_rows:.2f}",
    )
    return SharedStepCosts(fixed_rows, token_rows, key_rows, prompt_key_rows, logprob_rows)
