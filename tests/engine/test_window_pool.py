"""The windowed layers' KV pool (engine.block_manager, Gemma 2 and 3): blocks that fall out of the
window are freed while the sequence runs, prefix hits need the window's blocks too, and the
engine's outputs stay transformers' with a window pool far smaller than the main one."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import NO_BLOCK, BlockManager
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine.test_block_manager import Params, kv
from tests.engine.test_parity import Recorder, _prompts

BS = 4
WINDOW = 6  # a query at p sees p - 5 .. p: one or two blocks back


def make_seq(tokens: list[int], **kw) -> Sequence:
    return Sequence("r", tokens, Params(), **kw)


def step(bm: BlockManager, seq: Sequence, n: int, hits=()) -> None:
    """What a scheduled step does (engine.scheduler): slots, the KV written, then the new full
    blocks registered and what left the window released."""
    bm.allocate(seq, n, hits)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    bm.release_out_of_window(seq)


def test_blocks_before_the_window_are_freed_as_the_sequence_advances():
    bm = BlockManager(16, BS, window=WINDOW, num_window_blocks=4)
    seq = make_seq(list(range(30)))
    step(bm, seq, 8)  # positions 0-7: blocks 0, 1
    assert seq.window_block_table.count(NO_BLOCK) == 0 and len(seq.window_block_table) == 2
    step(bm, seq, 8)  # the next query is at 16: its window starts at 11, in block 2
    assert seq.window_block_table[:2] == [NO_BLOCK, NO_BLOCK]
    assert NO_BLOCK not in seq.window_block_table[2:]
    step(bm, seq, 8)  # next at 24, window from 19 (block 4): blocks 0-3 freed
    assert seq.window_block_table[:4] == [NO_BLOCK] * 4 and len(seq.window_block_table) == 6
    assert len(seq.block_table) == 6  # the full layers keep every block
    assert bm.windowed is not None and bm.windowed.num_free_blocks == 2
    bm.check_invariants()
    bm.check_holders([seq])
    # 30 tokens would need 8 blocks without freeing; the window pool has 4.
    step(bm, seq, 6)
    assert len(seq.window_block_table) == 8 and bm.windowed.num_free_blocks == 2  # 6 and 7 held
    bm.free(seq)
    assert bm.windowed.num_free_blocks == 4 and bm.num_free_blocks == 16
    bm.check_invariants()


def test_a_prefix_hit_takes_the_windows_blocks_from_the_cache_or_is_shortened():
    bm = BlockManager(32, BS, window=WINDOW, num_window_blocks=6)
    assert bm.windowed is not None
    tokens = list(range(20))
    first = make_seq(tokens)
    step(bm, first, 20)
    bm.free(first)
    second = make_seq(tokens + [99])
    hits = bm.get_computed_blocks(second)
    # All 5 blocks hit; the next query (position 20) sees 15-20, so blocks 3 and 4 come from the
    # window pool's cache.
    assert len(hits) == 5 and len(hits.window_ids) == 2
    step(bm, second, 1, hits)
    assert second.window_block_table[:3] == [NO_BLOCK] * 3
    bm.check_holders([second])
    bm.free(second)
    # Other sequences take the whole window pool: the cached window blocks are evicted, so no
    # hit can be served (the full layers' blocks alone are not enough).
    for i in range(3):
        step(bm, make_seq([100 + i] * 8), 8)
    third = make_seq(tokens + [98])
    assert bm.get_computed_blocks(third) == []
    bm.check_invariants()


def test_a_rejected_draft_is_trimmed_from_both_tables():
    bm = BlockManager(16, BS, window=WINDOW, num_window_blocks=6)
    seq = make_seq(list(range(10)))
    step(bm, seq, 10)
    bm.allocate(seq, 5)  # one token and a 4-token draft: positions 10-14, blocks 2 and 3
    assert len(seq.window_block_table) == 4
    seq.num_computed_tokens += 1  # only the sampled token's position kept
    bm.trim(seq, seq.num_computed_tokens + 1)
    assert len(seq.block_table) == len(seq.window_block_table) == 3
    bm.check_invariants()
    bm.check_holders([seq])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 1), min_size=1, max_size=20)),
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("draft"), st.integers(0, 7), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 7)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(3, 12), num_window_blocks=st.integers(3, 8))
def test_random_operations_keep_both_pools_consistent_and_the_windows_kv_correct(
    ops, num_blocks, num_window_blocks
):
    bm = BlockManager(num_blocks, BS, window=WINDOW, num_window_blocks=num_window_blocks)
    assert bm.windowed is not None
    slots: dict[int, tuple] = {}  # the full layers' simulated KV cache
    window_slots: dict[int, tuple] = {}  # the windowed layers'
    live: list[Sequence] = []

    def write(seq: Sequence, start: int, end: int) -> None:
        for pos, slot, wslot in zip(
            range(start, end),
            bm.compute_slot_mapping(seq, start, end),
            bm.compute_window_slot_mapping(seq, start, end),
            strict=True,
        ):
            slots[slot] = window_slots[wslot] = kv(seq, pos)

    def check_readable(seq: Sequence) -> None:
        """What the next query reads: every earlier position for the full layers, its window for
        the windowed ones, each holding the KV of this sequence's own tokens."""
        for pos in range(seq.num_computed_tokens):
            assert slots[bm.compute_slot_mapping(seq, pos, pos + 1)[0]] == kv(seq, pos)
        for pos in range(max(0, seq.num_computed_tokens - WINDOW + 1), seq.num_computed_tokens):
            table = seq.window_block_table
            slot = table[pos // BS] * BS + pos % BS
            assert window_slots[slot] == kv(seq, pos)

    for op in ops:
        if op[0] == "new":
            seq = make_seq(op[1])
            hits = bm.get_computed_blocks(seq)
            if not bm.can_allocate(seq, 1, hits):
                continue
            bm.allocate(seq, 1, hits)
            check_readable(seq)
            live.append(seq)
            write(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1)
            seq.num_computed_tokens += 1
            bm.cache_full_blocks(seq)
            bm.release_out_of_window(seq)
        elif op[0] == "step" and live:
            seq = live[op[1] % len(live)]
            n = op[2]
            while seq.num_tokens < seq.num_computed_tokens + n:
                seq.append_token(seq.num_tokens % 2)
            if not bm.can_allocate(seq, n):
                continue
            start = seq.num_computed_tokens
            bm.allocate(seq, n)
            check_readable(seq)
            write(seq, start, start + n)
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            bm.release_out_of_window(seq)
        elif op[0] == "draft" and live:
            # A decoding sequence verifies its last token and a draft of op[3] tokens, of which
            # the first op[2] - 1 are accepted; the rejected ones differ from what follows them
            # (the sample at the first rejected position), so stale KV would show.
            seq = live[op[1] % len(live)]
            if seq.num_tokens != seq.num_computed_tokens + 1:
                continue
            accepted = min(op[2] - 1, op[3])
            for i in range(op[3]):
                token = seq.num_tokens % 2
                seq.append_token(token if i < accepted else 1 - token)
            n = 1 + op[3]
            if not bm.can_allocate(seq, n):
                del seq._token_ids[seq.num_computed_tokens + 1 :]
                del seq.output_token_ids[len(seq._token_ids) - seq.num_prompt_tokens :]
                continue
            start = seq.num_computed_tokens
            bm.allocate(seq, n)
            check_readable(seq)
            write(seq, start, start + n)
            seq.num_computed_tokens = start + 1 + accepted
            bm.trim(seq, seq.num_computed_tokens + 1)
            del seq._token_ids[seq.num_computed_tokens :]  # the rejected drafts
            del seq.output_token_ids[len(seq._token_ids) - seq.num_prompt_tokens :]
            seq.append_token(seq.num_tokens % 2)  # the sample after the accepted ones
            bm.cache_full_blocks(seq)
            bm.release_out_of_window(seq)
        elif op[0] == "free" and live:
            bm.free(live.pop(op[1] % len(live)))
        bm.check_invariants()
        bm.check_holders(live)
        window_held = {b for s in live for b in s.window_block_table if b != NO_BLOCK}
        assert bm.windowed.num_free_blocks == num_window_blocks - len(window_held)

    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and bm.windowed.num_free_blocks == num_window_blocks


def _checked_each_step(llm: LLM, seen: list[int]) -> None:
    """Both pools' holders checked after every step; the window pool's use recorded."""
    sched = llm.engine.scheduler
    bm = sched.block_manager
    original = sched.update_from_output

    def update(*args, **kwargs):
        out = original(*args, **kwargs)
        bm.check_invariants()
        bm.check_holders(sched.running)
        assert bm.windowed is not None
        seen.append(bm.windowed.num_total_blocks - bm.windowed.num_free_blocks)
        return out

    sched.update_from_output = update


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("tiny_gemma2_dir", "torch"), ("tiny_gemma3_dir", "torch"), ("tiny_gemma2_dir", "triton")],
)
def test_long_sequences_run_in_a_small_window_pool_and_match_transformers(
    arch: str, backend: str, request: pytest.FixtureRequest
) -> None:
    """On the torch backend (CPU) and the Triton kernels (the GPU's; interpreted without one)."""
    model_dir: Path = request.getfixturevalue(arch)
    # 4 sequences of up to 130 tokens need 36 blocks of 16 in the full layers; the windowed
    # layers (a 32-token window) get a pool of 4 x 4 + 3 = 19 blocks.
    llm = LLM(
        str(model_dir), num_blocks=64, max_num_seqs=4, max_num_batched_tokens=48, attention_backend=backend
    )
    bm = llm.engine.scheduler.block_manager
    assert bm.windowed is not None and bm.windowed.num_total_blocks == 19 and bm.num_total_blocks == 64
    assert llm.engine.runner.kv_caches[0][0].shape[0] == 20  # layer 0 is windowed: 19 + scratch
    seen: list[int] = []
    _checked_each_step(llm, seen)
    rec = Recorder(llm)
    prompts = _prompts([90, 70, 85, 60], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(prompts, params)
    # Prefix-cache reruns: the prompts' blocks in both pools, the window pool's for each prompt's
    # last 32 positions (after the long run above its cached blocks were recycled: no hits then).
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    others = _prompts([90, 75], seed=12)
    llm.generate(others, short)
    again = llm.generate([p + [5] for p in others], short)
    assert [o.num_cached_tokens for o in again] == [80, 64]  # every full block of 16 before the last token
    assert max(seen) <= 19
    assert rec.check_against(model_dir) > 0
    assert llm.engine.scheduler.num_preemptions == 0


def test_the_main_pool_takes_what_the_windowed_layers_no_longer_need(tiny_gemma3_dir: Path) -> None:
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine_setup import resolve_num_blocks, window_pool_need
    from engine.model_runner import kv_cache_bytes_per_block
    from engine.models import load_model

    model = load_model(tiny_gemma3_dir, TorchAttentionBackend())
    budget = 64 * 1024**2
    config = EngineConfig(
        model=str(tiny_gemma3_dir),
        cache=CacheConfig(kv_cache_memory_bytes=budget),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )
    main, window = resolve_num_blocks(config, model, model.model.embed_tokens.weight.device, 100_000, None)
    single_pool = budget // kv_cache_bytes_per_block(model, 16)
    assert window == window_pool_need(model.config, config.scheduler, 16) < single_pool
    # With w of its L layers windowed, the full layers' pool is nearly L / (L - w) times a single
    # pool's (twice here: one windowed layer of two).
    windowed = sum(1 for w in model.config.layer_windows if w is not None)
    assert windowed >= 1
    assert main >= 0.95 * single_pool * model.config.num_layers / (model.config.num_layers - windowed)
    per_layer = kv_cache_bytes_per_block(model, 16) // model.config.num_layers
    assert main * per_layer * (model.config.num_layers - windowed) + window * per_layer * windowed <= budget


def test_a_model_windowed_in_every_layer_keeps_all_its_kv_in_the_window_pool(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine_setup import resolve_num_blocks
    from engine.model_runner import kv_cache_bytes_per_block
    from engine.models import load_model

    model_dir = tmp_path / "all-windowed"
    shutil.copytree(tiny_gemma3_dir, model_dir)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw["layer_types"] = ["sliding_attention"] * raw["num_hidden_layers"]
    config_path.write_text(json.dumps(raw))
    model = load_model(model_dir, TorchAttentionBackend())
    budget = 1024**2  # 128 blocks of every layer, fewer than 4 sequences of 512 could fill
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(kv_cache_memory_bytes=budget),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    main, window = resolve_num_blocks(config, model, model.model.embed_tokens.weight.device, 512, None)
    assert window == budget // kv_cache_bytes_per_block(model, 16)  # the whole budget
    assert main == 2 * 4 * 512 // 16  # positions only: no layer stores K/V there
    llm = LLM(
        str(model_dir),
        kv_cache_memory_bytes=budget,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
    )
    assert {k.shape[0] for k, _ in llm.engine.runner.kv_caches} == {window + 1}
    rec = Recorder(llm)
    llm.generate(_prompts([70, 40], seed=13), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert rec.check_against(model_dir) > 0
