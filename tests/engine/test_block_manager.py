from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, compute_slot_mapping
from engine.sequence import Sequence

BS = 4


@dataclass
class Params:
    max_tokens: int = 8
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def make_seq(tokens: list[int], **kw) -> Sequence:
    return Sequence("r", tokens, Params(), **kw)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What a scheduled step does to the block manager: slots first, then the KV is written."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def prefill_and_free(bm: BlockManager, tokens: list[int], **kw) -> list[int]:
    seq = make_seq(tokens, **kw)
    compute(bm, seq, len(tokens))
    table = list(seq.block_table)
    bm.free(seq)
    return table


def test_prefix_hit_never_covers_the_last_prompt_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))  # exactly two full blocks
    table = prefill_and_free(bm, prompt)

    # The second block holds the last token, which must be computed again to be sampled from.
    assert bm.get_computed_blocks(make_seq(prompt)) == table[:1]
    # One token more and both full blocks are reusable.
    assert bm.get_computed_blocks(make_seq(prompt + [99])) == table[:2]


def test_same_prompt_with_another_salt_or_adapter_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    prefill_and_free(bm, prompt, cache_salt="tenant-a", lora_id=0)

    assert len(bm.get_computed_blocks(make_seq(prompt, cache_salt="tenant-a", lora_id=0))) == 2
    assert bm.get_computed_blocks(make_seq(prompt, cache_salt="tenant-b", lora_id=0)) == []
    assert bm.get_computed_blocks(make_seq(prompt, cache_salt=None, lora_id=0)) == []
    assert bm.get_computed_blocks(make_seq(prompt, cache_salt="tenant-a", lora_id=1)) == []


def test_hash_is_chained_so_a_block_matches_only_after_the_same_prefix():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefill_and_free(bm, [1, 1, 1, 1, 2, 2, 2, 2, 3])

    # Second block's tokens are identical, but they follow a different first block.
    assert bm.get_computed_blocks(make_seq([9, 9, 9, 9, 2, 2, 2, 2, 3])) == []


def test_freed_block_is_reused_by_a_later_identical_prompt():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    table = prefill_and_free(bm, prompt)
    assert bm.num_free_blocks == 8  # freed, yet still cached

    seq = make_seq(prompt)
    hits = bm.get_computed_blocks(seq)
    bm.allocate(seq, seq.num_tokens - len(hits) * BS, hits)

    assert seq.block_table[:2] == table[:2]
    assert seq.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    assert bm.prefix_cache_stats() == {"queries": 20, "hits": 8, "hit_rate": 0.4}


def test_cached_block_is_evicted_only_when_reallocated_least_recently_freed_first():
    bm = BlockManager(num_blocks=3, block_size=BS)
    old = prefill_and_free(bm, [1] * 5)  # a cached full block and an uncached partial one
    new = prefill_and_free(bm, [2] * 5)  # recycles old's partial block, not its cached one
    assert old[0] not in new
    assert len(bm.cached_block_ids) == 2

    # The one uncached free block goes first; both cached prefixes survive.
    taker = make_seq([7] * 4)
    compute(bm, taker, 4)
    assert taker.block_table == [new[1]]
    assert bm.get_computed_blocks(make_seq([1] * 5)) == [old[0]]

    # One more block: the least recently freed cached block ([1] * 4) is the one evicted.
    bm.allocate(taker, 1)
    assert taker.block_table[-1] == old[0]
    assert bm.get_computed_blocks(make_seq([1] * 5)) == []
    assert bm.get_computed_blocks(make_seq([2] * 5)) == [new[0]]
    bm.check_invariants()


def test_shared_block_stays_allocated_until_its_last_holder_frees_it():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([3] * 6)
    compute(bm, a, 6)
    b = make_seq([3] * 6)
    hits = bm.get_computed_blocks(b)
    bm.allocate(b, 2, hits)
    shared = a.block_table[0]
    assert hits == [shared] and bm.blocks[shared].ref_count == 2

    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_block_queue

    bm.free(b)
    assert bm.blocks[shared].ref_count == 0 and bm.num_free_blocks == 4


def test_can_allocate_counts_a_revived_cache_hit_as_no_longer_free():
    bm = BlockManager(num_blocks=2, block_size=BS)
    prefill_and_free(bm, [5] * 5)
    seq = make_seq([5] * 9)
    hits = bm.get_computed_blocks(seq)
    assert len(hits) == 1

    # 9 tokens need 3 blocks; the hit gives one, but claiming it leaves only one free block.
    assert not bm.can_allocate(seq, 5, hits)
    assert bm.can_allocate(seq, 4, hits)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    prefill_and_free(bm, [1] * 9)

    assert bm.get_computed_blocks(make_seq([1] * 9)) == []
    assert bm.cached_block_ids == {}


def test_slot_mapping_walks_the_block_table():
    assert compute_slot_mapping([7, 2, 5], 4, 2, 10) == [30, 31, 8, 9, 10, 11, 20, 21]
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq([0] * 6)
    bm.allocate(seq, 6)
    assert bm.compute_slot_mapping(seq, 0, 6) == compute_slot_mapping(seq.block_table, BS, 0, 6)


def test_usage_is_the_fraction_of_held_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq([0] * 5)
    bm.allocate(seq, 5)

    assert bm.num_total_blocks == 4 and bm.num_free_blocks == 2 and bm.usage == 0.5


# -- properties ---------------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("new"),
            st.lists(st.integers(0, 1), min_size=1, max_size=14),
            st.sampled_from([(0, None), (0, "a"), (1, None)]),
        ),
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 7)),
    ),
    max_size=60,
)


def kv(seq: Sequence, pos: int) -> tuple:
    """What the KV at pos depends on: every token up to it, the adapter and (for isolation) the salt."""
    return (seq.lora_id, seq.cache_salt, tuple(seq.token_ids[: pos + 1]))


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 10))
def test_random_operations_keep_the_pool_consistent_and_cached_kv_correct(ops, num_blocks):
    bm = BlockManager(num_blocks=num_blocks, block_size=BS)
    slots: dict[int, tuple] = {}  # the simulated KV cache
    live: list[Sequence] = []
    for op in ops:
        if op[0] == "new":
            _, tokens, (lora_id, salt) = op
            seq = make_seq(tokens, lora_id=lora_id, cache_salt=salt)
            hits = bm.get_computed_blocks(seq)
            if not bm.can_allocate(seq, 1, hits):
                continue
            bm.allocate(seq, 1, hits)
            # A hit must hand over exactly the KV this sequence would have computed.
            for pos in range(seq.num_computed_tokens):
                assert slots[bm.compute_slot_mapping(seq, pos, pos + 1)[0]] == kv(seq, pos)
            assert seq.num_computed_tokens < seq.num_tokens
            live.append(seq)
            seq.num_computed_tokens += 1
            slots[bm.compute_slot_mapping(seq, seq.num_computed_tokens - 1, seq.num_computed_tokens)[0]] = kv(
                seq, seq.num_computed_tokens - 1
            )
            bm.cache_full_blocks(seq)
        elif op[0] == "step" and live:
            seq = live[op[1] % len(live)]
            while seq.num_tokens < seq.num_computed_tokens + op[2]:
                seq.append_token(seq.num_tokens % 2)
            if not bm.can_allocate(seq, op[2]):
                continue
            start = seq.num_computed_tokens
            bm.allocate(seq, op[2])
            for pos, slot in zip(
                range(start, start + op[2]), bm.compute_slot_mapping(seq, start, start + op[2]), strict=True
            ):
                slots[slot] = kv(seq, pos)
            seq.num_computed_tokens += op[2]
            bm.cache_full_blocks(seq)
        elif op[0] == "free" and live:
            bm.free(live.pop(op[1] % len(live)))

        bm.check_invariants()
        held = [b for s in live for b in s.block_table]
        for block in bm.blocks:
            assert block.ref_count == held.count(block.block_id)
        assert bm.num_free_blocks == num_blocks - len(set(held))

    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
