"""Shared step width (engine.step_width): while tenants share a replica, the widest tenants'
decodes take turns and their prompts go a chunk a step, so that a step stays within
shared_step_slowdown x the least demanding tenant's own."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.rules import SERVICE_TIER_PRIORITY
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_width import LINGER_S, SPARE_CUT_S, RowCosts, SharedStepWidth, tenant_cap, tenant_caps, width
from engine.warm_up import shared_step_costs


@dataclass
class Params:
    max_tokens: int
    n: int = 1
    prompt_logprobs: int | None = None


def _scheduler(
    *,
    fixed_rows: float | None,
    slowdown: float = 2.0,
    max_num_seqs: int = 64,
    prompt_token_rows: float | None = None,
    **costs: float,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=1024,
            max_num_seqs=max_num_seqs,
            max_model_len=256,
            shared_step_slowdown=slowdown,
            decode_fixed_rows=fixed_rows,
            prompt_token_rows=prompt_token_rows,
            **costs,
        ),
        CacheConfig(block_size=4),
        num_blocks=1024,
    )


def _add(
    sched: Scheduler,
    tenant: str,
    count: int,
    *,
    out: int = 1000,
    prompt: int = 8,
    prompt_logprobs: int | None = None,
    priority: int = 0,
) -> list[Sequence]:
    seqs = []
    for i in range(count):
        tokens = [100 + sum(map(ord, tenant)) % 300, *([1 + i % 50] * (prompt - 1))]
        params = Params(out, prompt_logprobs=prompt_logprobs)
        seq = Sequence(f"{tenant}{i}-{time.monotonic_ns()}", tokens, params, tenant=tenant, priority=priority)
        sched.add(seq)
        seqs.append(seq)
    return seqs


def _step(sched: Scheduler) -> Counter[str]:
    """One step with fake tokens; returns the decodes it ran per tenant."""
    out = sched.schedule()
    decodes = Counter(item.seq.tenant for item in out.scheduled if item.num_new_tokens == 1)
    sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
    return decodes


def _until_all_decode(sched: Scheduler) -> None:
    for _ in range(100):
        if all(s.num_uncomputed_tokens == 1 for s in sched.running) and not sched.num_waiting:
            return
        _step(sched)
    raise AssertionError("prompts still computing")


def test_the_width_is_the_least_demanding_tenants_step_times_the_slowdown_in_rows():
    # A step of b rows costs a + c b; fixed_rows = a / c. (a + c w) <= 2 (a + c 2): w <= a/c + 4.
    assert width(2.0, 9.0, 2) == 13
    assert width(2.0, 0.0, 5) == 10
    assert width(1.5, 10.0, 1) == 6.5
    assert width(1.5, 10.0, 36 * 0.5) == 32  # a 36-token prompt at half a row a token
    assert width(1.0, 50.0, 3) == 3  # never below the least demanding tenant's own rows


def test_the_per_tenant_cap_fills_the_width_from_the_smallest_tenant_up():
    assert tenant_cap([2, 126], 13) == 11
    assert tenant_cap([2, 50, 50], 12) == 5
    assert tenant_cap([2, 50, 50], 13) == 5.5
    assert tenant_cap([5, 5], 20) == 5  # everything fits
    assert tenant_cap([30], 13) == 13


def test_where_the_least_demand_does_not_fit_an_equal_cap_it_keeps_its_demand_and_the_others_share_the_rest():
    # An equal cap of 6 would hold the small tenant's prompt back; it keeps its 10 rows.
    assert tenant_caps({"small": 10, "wide": 100}, 12) == {"small": 10, "wide": 2}
    assert tenant_caps({"small": 10, "a": 100, "b": 50}, 14) == {"small": 10, "a": 2, "b": 2}
    assert tenant_caps({"small": 10, "a": 11, "b": 50}, 28) == {"small": 10, "a": 9, "b": 9}
    # Tenants of equal demand run together; every other tenant keeps at least a row.
    assert tenant_caps({"a": 10, "b": 10, "wide": 100}, 12) == {"a": 10, "b": 10, "wide": 1.0}
    # Where the equal cap covers the least demand, it is the cap for all, as before.
    assert tenant_caps({"small": 2, "wide": 126}, 13) == {"small": 11, "wide": 11}


def test_row_costs_price_context_and_prompt_logprobs():
    costs = RowCosts(token=0.5, key=0.01, prompt_key=0.001, logprob=0.25)
    (short,) = (Sequence("s", [1] * 50, Params(10)),)
    long = Sequence("l", [1] * 600, Params(10))
    short.num_computed_tokens, long.num_computed_tokens = 49, 599
    assert costs.decode(short) == 1.0  # within ROW_CONTEXT keys
    assert costs.decode(long) == pytest.approx(1.0 + 0.01 * 500)
    # t tokens from `start` attend t (start + 1) + t (t - 1) / 2 keys.
    plain = Sequence("p", [1] * 300, Params(10))
    assert costs.prompt(plain, 0, 4) == pytest.approx(4 * 0.5 + 0.001 * (4 + 6))
    assert costs.prompt(plain, 200, 4) == pytest.approx(4 * 0.5 + 0.001 * (4 * 201 + 6))
    scored = Sequence("q", [1] * 300, Params(10, prompt_logprobs=5))
    assert costs.prompt(scored, 0, 4) == pytest.approx(4 * 0.75 + 0.001 * (4 + 6))
    # prompt_tokens is the inverse: the most tokens that the rows pay for.
    for seq in (plain, scored):
        for start in (0, 7, 150):
            for rows in (0.0, 0.4, 1.0, 3.3, 10.0, 57.0):
                fit = costs.prompt_tokens(seq, start, rows, 100)
                assert costs.prompt(seq, start, fit) <= rows + 1e-9
                assert fit == 100 or costs.prompt(seq, start, fit + 1) > rows
    assert RowCosts(token=0.5).prompt_tokens(plain, 0, 3.0, 100) == 6


def test_a_wide_tenants_decodes_take_turns_beside_a_small_one():
    sched = _scheduler(fixed_rows=4.0)
    wide = _add(sched, "wide", 30)
    _until_all_decode(sched)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    sat_out = sched.num_sat_out
    # width = (2 - 1) x 4 + 2 x 2 = 8 rows: the small tenant's 2 and 6 of the wide one's.
    decoded = Counter()
    for _ in range(5):
        before = {s.seq_id: s.num_output_tokens for s in wide}
        per_tenant = _step(sched)
        assert per_tenant == {"small": 2, "wide": 6}
        decoded.update(s.seq_id for s in wide if s.num_output_tokens > before[s.seq_id])
    # Five steps of 6 turns: each of the 30 sequences decoded once, none twice.
    assert sorted(decoded.values()) == [1] * 30
    assert sched.num_sat_out - sat_out == 5 * 24
    assert all(s.status is SequenceStatus.RUNNING for s in wide)  # no one lost its KV blocks


def test_a_tenant_alone_decodes_every_sequence_each_step():
    sched = _scheduler(fixed_rows=4.0)
    _add(sched, "wide", 30)
    _until_all_decode(sched)
    assert _step(sched) == {"wide": 30}
    assert sched.num_sat_out == 0


def test_tenants_of_equal_size_run_together():
    sched = _scheduler(fixed_rows=0.0)
    _add(sched, "a", 10)
    _add(sched, "b", 10)
    _until_all_decode(sched)
    assert _step(sched) == {"a": 10, "b": 10}


def test_a_waiting_prompt_of_another_tenant_already_narrows_the_step():
    sched = _scheduler(fixed_rows=4.0)
    _add(sched, "wide", 30)
    _until_all_decode(sched)
    _add(sched, "small", 1)
    out = sched.schedule()
    decodes = [item for item in out.scheduled if item.seq.tenant == "wide"]
    prompt = [item for item in out.scheduled if item.seq.tenant == "small"]
    # width = 4 + 2 x 1 = 6 rows: the small one's prompt (one row without a prompt token's cost)
    # and 5 of the wide tenant's decodes.
    assert len(decodes) == 5 and len(prompt) == 1 and prompt[0].num_new_tokens == 8


@pytest.mark.parametrize("fixed_rows, slowdown", [(None, 2.0), (4.0, 0.0)])
def test_without_a_fixed_cost_or_with_the_bound_off_nothing_sits_out(fixed_rows, slowdown):
    sched = _scheduler(fixed_rows=fixed_rows, slowdown=slowdown)
    _add(sched, "wide", 30)
    _until_all_decode(sched)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    assert _step(sched) == {"wide": 30, "small": 2}


def _prompt_tokens(out, tenant: str) -> int:
    return sum(
        item.num_new_tokens for item in out.scheduled if item.seq.tenant == tenant and item.num_new_tokens > 1
    )


@pytest.mark.parametrize("prompt_token_rows", [0.5, None])
def test_a_long_prompt_is_computed_a_chunk_a_step_beside_another_tenants_decodes(prompt_token_rows):
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=prompt_token_rows)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    (long,) = _add(sched, "long", 1, prompt=200)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        chunks.append(_prompt_tokens(out, "long"))
        # The small tenant's streams decode every step.
        assert Counter(i.seq.tenant for i in out.scheduled if i.num_new_tokens == 1)["small"] == 2
        sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
    if prompt_token_rows is None:  # prompt tokens not priced: the whole prompt in one step
        assert chunks == [200]
        return
    # width = (2 - 1) x 4 + 2 x 2 = 8 rows: the small tenant's 2 decodes, and 6 rows of the long
    # prompt at half a row a token, 12 tokens a step.
    assert chunks == [12] * 16 + [8]


def test_the_least_demanding_tenants_prompt_is_not_held_back_beside_a_wide_tenants_decodes():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5)
    wide = _add(sched, "wide", 30)
    _until_all_decode(sched)
    _add(sched, "small", 1, prompt=36)
    out = sched.schedule()
    # The small tenant's step alone: its 36 prompt tokens, 18 rows. width = 4 + 2 x 18 = 40 rows:
    # all of its prompt, and 22 of the wide tenant's decodes.
    assert _prompt_tokens(out, "small") == 36
    assert sum(1 for item in out.scheduled if item.seq in wide) == 22


def test_the_least_demanding_tenants_prompt_goes_whole_and_the_other_prompt_takes_what_is_left():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5, slowdown=1.5)
    _add(sched, "long", 1, prompt=200)
    _add(sched, "small", 1, prompt=36)
    out = sched.schedule()
    # The small tenant's prompt alone: 18 rows. width = 0.5 x 4 + 1.5 x 18 = 29 rows: all of its
    # prompt, and the 11 rows left, 22 tokens, for the long one (not 18 rows to match it).
    assert _prompt_tokens(out, "small") == 36
    assert _prompt_tokens(out, "long") == 22


def test_a_waiting_prompt_counts_only_the_tokens_the_prefix_cache_lacks():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5)
    wide = _add(sched, "wide", 30)
    _until_all_decode(sched)
    (first,) = _add(sched, "small", 1, prompt=36)
    _until_all_decode(sched)
    sched.finish(first, SequenceStatus.FINISHED_LENGTH, "length")
    _add(sched, "small", 1, prompt=36)  # the same prompt: 32 of its tokens are cached
    out = sched.schedule()
    # The small tenant's step alone computes 4 tokens, 2 rows: width = 4 + 2 x 2 = 8 rows, 6 of
    # them the wide tenant's decodes (not 22, as for the whole prompt's 18 rows).
    assert _prompt_tokens(out, "small") == 4
    assert sum(1 for item in out.scheduled if item.seq in wide) == 6


def test_an_n_requests_waiting_siblings_count_in_its_demand():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    _add(sched, "wide", 32, prompt=8)  # an n request: 32 waiting sequences
    out = sched.schedule()
    # The wide tenant's demand is all 32 prompts (128 rows), not its first (4 rows, which would fit
    # beside the small tenant's 2 in the width of 4 + 2 x 2 = 8 and leave the rest unbounded): it
    # gets the 6 rows left, 12 prompt tokens, not all 256.
    assert sum(i.num_new_tokens for i in out.scheduled if i.seq.tenant == "wide") == 12  # all prompt
    assert Counter(i.seq.tenant for i in out.scheduled if i.num_new_tokens == 1)["small"] == 2


def test_a_waiting_head_whose_tenant_spent_its_rows_does_not_hold_back_another_tenants():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5)
    _add(sched, "small", 1)
    _until_all_decode(sched)
    _add(sched, "wide", 1, prompt=200)
    _step(sched)
    _add(sched, "wide", 3, prompt=40)
    sched.service.charge("small", output_tokens=10_000)  # the wide tenant's heads come first
    (new,) = _add(sched, "small", 1, prompt=8)
    assert sched.waiting.peek().tenant == "wide"
    out = sched.schedule()
    # width = 4 + 2 x 5 = 14 rows, 7 a tenant: the wide tenant's long prompt spends its 7, and its
    # waiting head waits for the next step; the small tenant's starts beside its decode.
    assert _prompt_tokens(out, "wide") == 14
    assert [i.num_new_tokens for i in out.scheduled if i.seq is new] == [4]  # 4 more are cached


def test_a_long_context_decode_costs_more_rows():
    sched = _scheduler(fixed_rows=5.0, prompt_token_rows=0.5, decode_key_rows=0.02)
    wide = _add(sched, "wide", 12, prompt=200)
    _until_all_decode(sched)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    # width = 5 + 2 x 2 = 9 rows: 7 for the wide tenant, whose decodes cost 1 + 0.02 x 100+ keys,
    # over 3 rows each: two a step (seven at one row each).
    for _ in range(3):
        assert _step(sched) == {"small": 2, "wide": 2}
    assert all(s.status is SequenceStatus.RUNNING for s in wide)


def test_a_prompt_that_wants_prompt_logprobs_costs_more_rows():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5, prompt_logprob_rows=0.5)
    _add(sched, "small", 2)
    _until_all_decode(sched)
    (scored,) = _add(sched, "scored", 1, prompt=200, prompt_logprobs=5)
    out = sched.schedule()
    # width = 4 + 2 x 2 = 8: 6 rows for the scored prompt, at a row a token (12 tokens unscored).
    assert _prompt_tokens(out, "scored") == 6 and scored.wants_prompt_logprobs


def test_a_tenant_whose_sequences_just_finished_still_narrows_the_step():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5)
    now = [100.0]
    sched.step_width = SharedStepWidth(2.0, 4.0, 0.5, clock=lambda: now[0])
    (small,) = _add(sched, "small", 1)
    (long,) = _add(sched, "long", 1, prompt=200)
    _step(sched)
    sched.finish(small, SequenceStatus.FINISHED_LENGTH, "length")
    # The small tenant's client sends its next request in a moment: meanwhile the long prompt
    # goes on a chunk a step: width = 4 + 2 x 1 = 6 rows, one of them the small tenant's, and 5
    # for 10 prompt tokens.
    now[0] += LINGER_S / 2
    out = sched.schedule()
    assert _prompt_tokens(out, "long") == 10
    sched.update_from_output(out, {})
    # Gone for longer: the long prompt has the step to itself, all of what is left of it.
    now[0] += LINGER_S
    left = long.num_prompt_tokens - long.num_computed_tokens
    out = sched.schedule()
    assert left > 150 and _prompt_tokens(out, "long") == left


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="shared_step_slowdown"):
        SchedulerConfig(shared_step_slowdown=0.5)
    with pytest.raises(ConfigError, match="decode_fixed_rows"):
        SchedulerConfig(decode_fixed_rows=-1.0)
    with pytest.raises(ConfigError, match="prompt_token_rows"):
        SchedulerConfig(prompt_token_rows=0.0)


def _engine(model_dir: Path, **scheduler) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=256, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, **scheduler),
            warm_up=False,
        )
    )


def _run(engine: LLMEngine, chunks: list[int] | None = None) -> dict[str, list[int]]:
    """Each request's greedy tokens; `chunks` gets the long prompt's tokens computed per step."""
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for i in range(12):
        engine.add_request(f"wide-{i}", [3, 5 + i, 7, 11 + i], greedy, tenant="wide")
    tokens: dict[str, list[int]] = {}
    engine.step()  # the wide tenant's prompts, alone
    for i in range(2):
        engine.add_request(f"small-{i}", [2, 9 + i, 4], greedy, tenant="small")
    engine.add_request("long", [(5 + 7 * i) % 200 + 3 for i in range(150)], greedy, tenant="long")
    (long,) = engine.scheduler.requests["long"]
    while engine.has_unfinished_requests():
        computed = long.num_computed_tokens
        outputs = engine.step()
        if chunks is not None and computed < long.num_prompt_tokens:
            chunks.append(min(long.num_computed_tokens, long.num_prompt_tokens) - computed)
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens


def test_sequences_that_sit_steps_out_decode_the_tokens_they_decode_without_the_bound(tiny_llama_dir: Path):
    whole: list[int] = []
    plain = _run(_engine(tiny_llama_dir, shared_step_slowdown=0.0), whole)
    engine = _engine(tiny_llama_dir, decode_fixed_rows=1.0, prompt_token_rows=1.0)
    chunks: list[int] = []
    bounded = _run(engine, chunks)
    assert engine.scheduler.num_sat_out > 0
    # Without the bound the long prompt is computed in one step; with it, a chunk a step, and its
    # completion is the same.
    assert whole == [150]
    assert len(chunks) > 5 and sum(chunks) == 150
    assert bounded == plain and len(bounded) == 15
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks


def test_warm_up_measures_the_decode_steps_fixed_cost_on_cpu(tiny_llama_dir: Path):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            cache=CacheConfig(num_blocks=512, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32),
        )
    )
    fixed = engine.scheduler.step_width.fixed_rows
    assert fixed is not None and 0.0 <= fixed <= 64 * 32
    token_rows = engine.scheduler.step_width.prompt_token_rows
    assert token_rows is not None and 0.0 < token_rows <= 64
    # The pool is too small for eight decodes of 1,100 tokens: the key costs are not measured.
    assert engine.scheduler.step_width.decode_key_rows is None
    logprob_rows = engine.scheduler.step_width.prompt_logprob_rows
    assert logprob_rows is not None and 0.0 <= logprob_rows <= 64
    # One sequence a step, or too few blocks for the probe's wide step: not measured.
    assert shared_step_costs(engine.runner, max_num_seqs=1, max_model_len=128) is None
    small = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            cache=CacheConfig(num_blocks=64, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32),
        )
    )
    assert small.scheduler.step_width.fixed_rows is None


def test_warm_up_measures_what_a_long_context_costs_where_the_pool_holds_the_probe(tiny_llama_dir: Path):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            cache=CacheConfig(num_blocks=1024, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, prompt_key_rows=0.5),
        )
    )
    width = engine.scheduler.step_width
    assert width.decode_key_rows is not None and 0.0 <= width.decode_key_rows <= 64
    assert width.prompt_key_rows == 0.5  # what the deployment set stands
    assert width.fixed_rows is not None and width.prompt_logprob_rows is not None


FLEX = SERVICE_TIER_PRIORITY["flex"]
DEFAULT = SERVICE_TIER_PRIORITY["default"]


def test_a_spare_capacity_tenant_never_narrows_a_more_important_tenants_prompt():
    # The batch tenant's 6 flex decodes are the least demand; were it counted as the least, the
    # width would be 4 + 2 x 6 = 16 rows and the chat tenant's 40-token prompt would take three
    # steps. The width is the chat tenant's own: its prompt is computed in one step, and the flex
    # decodes sit that step out (engine.scheduler.TierGate).
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=1.0)
    _add(sched, "batch", 6, priority=FLEX)
    _until_all_decode(sched)
    (chat,) = _add(sched, "chat", 1, prompt=40, priority=DEFAULT)
    out = sched.schedule()
    assert [(i.seq.tenant, i.num_new_tokens) for i in out.scheduled] == [("chat", 40)]
    assert chat.num_uncomputed_tokens == 40


def test_a_spare_capacity_tenant_decodes_in_what_the_width_leaves_beside_the_more_important_one():
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=1.0)
    _add(sched, "batch", 30, priority=FLEX)
    _until_all_decode(sched)
    _add(sched, "chat", 2, priority=DEFAULT)
    _until_all_decode(sched)
    # width = (2 - 1) x 4 + 2 x 2 = 8 rows: the chat tenant's 2, and 6 for the flex tenant.
    for _ in range(4):
        assert _step(sched) == Counter({"chat": 2, "batch": 6})


def test_the_spare_capacity_tier_is_bounded_by_the_more_important_tenants_alone_not_by_each_other():
    # Two chat tenants, one decoding 2 sequences and one computing a 12-token prompt, and a flex
    # tenant with 30 decodes: the width is set by the chat tenants (the least: 2 rows, 8 in all),
    # they keep their demand, the flex tenant gets what is left.
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.25, max_num_seqs=64)
    _add(sched, "batch", 30, priority=FLEX)
    _until_all_decode(sched)
    _add(sched, "chat", 2, priority=DEFAULT)
    _until_all_decode(sched)
    _add(sched, "other", 1, prompt=12, priority=DEFAULT)
    out = sched.schedule()
    by_tenant = Counter()
    for item in out.scheduled:
        by_tenant[item.seq.tenant] += item.num_new_tokens
    # A more important prompt is computed in this step: the flex decodes sit it out.
    assert by_tenant == Counter({"chat": 2, "other": 12})


@pytest.mark.parametrize("interruptible", [False, True], ids=["steps-kept", "steps-given-up"])
def test_a_lingering_tenant_narrows_spare_capacity_steps_only_where_they_are_not_given_up_on_arrival(
    interruptible: bool,
):
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=1.0)
    now = [100.0]
    sched.step_width = SharedStepWidth(2.0, 4.0, 1.0, clock=lambda: now[0])
    sched.step_width.spare_steps_interruptible = interruptible
    _add(sched, "batch", 30, priority=FLEX)
    _until_all_decode(sched)
    (chat,) = _add(sched, "chat", 1, priority=DEFAULT)
    _until_all_decode(sched)
    sched.finish(chat, SequenceStatus.FINISHED_LENGTH, "length")
    now[0] += LINGER_S / 2
    # The chat tenant's next request is on its way. Where the batch's steps are given up when it
    # arrives (engine.step_interrupt), they run whole meanwhile; else within width = 4 + 2 x 1 = 6
    # rows, one of them the lingering tenant's.
    assert _step(sched) == Counter({"batch": 30 if interruptible else 5})
    # A more important tenant with sequences running narrows them either way.
    _add(sched, "other", 1, priority=DEFAULT)
    _until_all_decode(sched)
    assert _step(sched)["batch"] < 30


def _after_a_chat(elapsed_s: float, *, interruptible: bool) -> Scheduler:
    """16 slots at half a row a prompt token, `elapsed_s` after a chat request ended."""
    sched = _scheduler(fixed_rows=4.0, prompt_token_rows=0.5, max_num_seqs=16)
    now = [100.0]
    sched.step_width = SharedStepWidth(2.0, 4.0, 0.5, clock=lambda: now[0])
    sched.step_width.spare_steps_interruptible = interruptible
    (chat,) = _add(sched, "chat", 1, prompt=8, out=1, priority=DEFAULT)
    _step(sched)
    sched.finish(chat, SequenceStatus.FINISHED_LENGTH, "length")
    now[0] += elapsed_s
    return sched


@pytest.mark.parametrize("interruptible", [False, True], ids=["steps-kept", "steps-given-up"])
def test_a_step_of_spare_capacity_prompts_alone_computes_at_most_a_decode_steps_rows_where_it_is_given_up(
    interruptible: bool,
):
    """A request arriving during a step that is given up for it waits for the layer under way: a
    wave of batch prompts in one step made that most of a decode step's time (engine.step_width
    .spare_prompt_tokens). 16 slots at half a row a prompt token: 32 prompt tokens a step."""
    # Interactive traffic ran a while ago (within SPARE_CUT_S).
    sched = _after_a_chat(SPARE_CUT_S / 2, interruptible=interruptible)
    lines = _add(sched, "batch", 8, prompt=16, priority=FLEX)
    out = sched.schedule()
    assert out.num_batched_tokens == (32 if interruptible else 128)
    sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
    if interruptible:
        # The rest a chunk a step, beside the decodes of the lines that started.
        for _ in range(3):
            out = sched.schedule()
            prompt_tokens = sum(
                i.num_new_tokens for i in out.scheduled if i.start_pos < i.seq.num_prompt_tokens
            )
            assert prompt_tokens <= 32
            sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
    _until_all_decode(sched)
    assert all(seq.num_computed_tokens >= 16 for seq in lines)
    # A more important request's prompt is computed whole in one step, whatever the cap.
    (chat,) = _add(sched, "chat", 1, prompt=100, priority=DEFAULT)
    out = sched.schedule()
    # (its first tokens may be prefix-cache hits of the earlier chat prompt)
    assert [(item.seq.seq_id, item.end_pos) for item in out.scheduled] == [(chat.seq_id, 100)]


def test_without_measured_costs_spare_capacity_prompts_are_not_cut():
    sched = _scheduler(fixed_rows=None, max_num_seqs=16)  # a GPU: nothing measured
    sched.step_width.spare_steps_interruptible = True
    _add(sched, "batch", 8, prompt=16, priority=FLEX)
    assert sched.schedule().num_batched_tokens == 128


def test_a_batch_alone_on_its_replica_computes_its_prompts_in_whole_steps():
    """Without more important traffic for SPARE_CUT_S, nothing is waited for: no cut."""
    sched = _after_a_chat(SPARE_CUT_S, interruptible=True)
    _add(sched, "batch", 8, prompt=16, priority=FLEX)
    assert sched.schedule().num_batched_tokens == 128
