"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, automatic prefix caching.

A full block is keyed by a hash chained over (parent block hash, its token ids, adapter id, cache
salt), so two sequences share a block only when everything before it matches too. Freed blocks keep
their content and hash in an LRU free queue; a cached block is forgotten only when reallocated.

A model whose windowed layers share one window (Gemma 2 and 3: `ModelConfig.kv_window`) keeps those
layers' K/V in a second pool with a table of its own per sequence (`Sequence.window_block_table`),
as vLLM's hybrid allocator keeps a group per attention kind. A block there is freed as soon as it
lies wholly before the window of every query still to come; its entry becomes NO_BLOCK, which the
windowed attention never reads. The window pool caches prefixes as the main one does, under the
same hashes: a prefix hit needs both pools' blocks, the window pool's only for the hit's last
window of positions, so a hit is shortened to where those are still cached.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from engine.sequence import Sequence

_NO_PARENT = b"\x00" * 32

NO_BLOCK = -1  # a window-table entry whose block fell out of the window (read as block 0: never)


def hash_block(parent: bytes | None, token_ids: Seq[int], lora_id: int, cache_salt: str | None) -> bytes:
    """sha256, not Python's hash(): a tenant able to craft a collision would read another's KV."""
    h = hashlib.sha256(parent or _NO_PARENT)
    # Fixed-width header first, so the variable-length salt at the end cannot alias the tokens.
    h.update(struct.pack("<qq", lora_id, len(token_ids)))
    h.update(array("q", token_ids).tobytes())
    h.update(b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode())
    return h.digest()


def compute_slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat KV-cache slot of each position in [start, end)."""
    assert 0 <= start <= end <= len(block_table) * block_size, (start, end, len(block_table))
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


class BlockHits(list[int]):
    """get_computed_blocks' answer: the main pool's cached blocks, and the window pool's for the
    last window of their positions (empty without a window pool)."""

    window_ids: list[int]

    def __init__(self, ids: list[int], window_ids: list[int] | None = None) -> None:
        super().__init__(ids)
        self.window_ids = window_ids or []


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        window: int | None = None,
        num_window_blocks: int = 0,
    ) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first: allocation pops from the front.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}
        # seq_id -> how many leading blocks of its table are already registered in the cache.
        self._num_registered: dict[int, int] = {}
        self._num_queries = 0
        self._num_hits = 0
        # The windowed layers' pool (a manager of its own used for its blocks, free queue and
        # cache only), or None.
        self.window = window
        self.windowed: BlockManager | None = None
        if window is not None:
            assert window >= 1 and num_window_blocks >= 1
            self.windowed = BlockManager(num_window_blocks, block_size, enable_prefix_caching)

    # -- capacity -----------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, including cached ones that a lookup could still revive."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Hashes of the first num_full_blocks blocks of seq, extending its memo as needed."""
        hashes, bs = seq.block_hashes, self.block_size
        assert num_full_blocks * bs <= seq.num_tokens
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, seq.lora_id, seq.cache_salt))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks prefixing seq. Pure: nothing is claimed until allocate().

        The last token is never covered: the step must compute at least it to have logits to sample.
        """
        if not self.enable_prefix_caching:
            return []
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits: list[int] = []
        for h in self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.cached_block_ids.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.windowed is None or not hits:
            return hits
        # The window pool must hold the blocks the first query after the hit can see.
        cached = self.windowed.cached_block_ids
        for k in range(len(hits), 0, -1):
            window_ids = [
                cached.get(h) for h in seq.block_hashes[self.window_start_block(k * self.block_size) : k]
            ]
            if None not in window_ids:
                return BlockHits(hits[:k], window_ids)  # type: ignore[arg-type]
        return []

    def window_start_block(self, num_computed: int) -> int:
        """The first block the window of a query at position num_computed (the next to compute)
        reaches; the queries after it reach no further back."""
        assert self.window is not None
        return max(0, num_computed - self.window + 1) // self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of seq whose tokens are now all computed, so later lookups find them."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(seq.seq_id, 0)
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if end <= start:
            return
        hashes = self.block_hashes(seq, end)
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:  # shared from the cache already
                assert block.hash == hashes[i]
                continue
            # Two sequences that computed the same block in one step: the first keeps the entry and
            # the duplicate stays anonymous, to be recycled first once freed.
            if hashes[i] not in self.cached_block_ids:
                block.hash = hashes[i]
                self.cached_block_ids[hashes[i]] = block.block_id
        if self.windowed is not None:
            w = self.windowed
            for i in range(start, end):
                block_id = seq.window_block_table[i]
                if block_id == NO_BLOCK or w.blocks[block_id].hash is not None:
                    continue
                if hashes[i] not in w.cached_block_ids:
                    w.blocks[block_id].hash = hashes[i]
                    w.cached_block_ids[hashes[i]] = block_id
        self._num_registered[seq.seq_id] = end

    def prefix_cache_stats(self) -> dict[str, int | float]:
        q, h = self._num_queries, self._num_hits
        return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}

    # -- allocation ---------------------------------------------------------------------------

    def _num_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int]) -> int:
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total = self.num_blocks_for(num_computed + num_new_tokens)
        return max(0, total - len(seq.block_table) - len(computed_blocks))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        # A cache hit sitting in the free queue stops being free once claimed.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        needed = self._num_blocks_needed(seq, num_new_tokens, computed_blocks)
        if needed > self.num_free_blocks - revived:
            return False
        return self.windowed is None or self._window_fits(
            seq, len(seq.block_table) + len(computed_blocks) + needed, computed_blocks
        )

    def _window_plan(self, seq: Sequence, computed_blocks: Seq[int]) -> tuple[int, list[int], list[int]]:
        """(first block the window needs, the hits' window blocks to claim, held blocks to release)."""
        num_computed = len(computed_blocks) * self.block_size if computed_blocks else seq.num_computed_tokens
        first = self.window_start_block(num_computed)
        claims = getattr(computed_blocks, "window_ids", [])
        table = seq.window_block_table
        released = [b for b in table[: min(first, len(table))] if b != NO_BLOCK]
        return first, claims, released

    def _window_fits(self, seq: Sequence, total_blocks: int, computed_blocks: Seq[int]) -> bool:
        """Whether the window pool can give seq a table of total_blocks entries: NO_BLOCK before
        the window, the hits' window blocks, then new blocks (after releasing what left the window)."""
        w = self.windowed
        assert w is not None
        _, claims, released = self._window_plan(seq, computed_blocks)
        # With hits the table starts empty and ends at the hits' last block; else it grows on.
        needed = total_blocks - (len(computed_blocks) if computed_blocks else len(seq.window_block_table))
        freed = sum(1 for b in released if w.blocks[b].ref_count == 1)
        revived = sum(1 for b in claims if w.blocks[b].ref_count == 0)
        return needed <= w.num_free_blocks + freed - revived

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> None:
        """Give seq slots for num_new_tokens more tokens, first claiming the prefix-cache hits
        (which advances seq.num_computed_tokens past them)."""
        assert self.can_allocate(seq, num_new_tokens, computed_blocks)
        needed = self._num_blocks_needed(seq, num_new_tokens, computed_blocks)
        if computed_blocks or not seq.block_table:
            assert not seq.block_table and seq.num_computed_tokens == 0
            if self.enable_prefix_caching and seq.num_preemptions == 0:
                self._num_queries += seq.num_tokens
                self._num_hits += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if computed_blocks:
            seq.num_computed_tokens = len(computed_blocks) * self.block_size
            self._num_registered[seq.seq_id] = len(computed_blocks)
        for _ in range(needed):
            seq.block_table.append(self._pop_free_block())
        if self.windowed is not None:
            self._allocate_window(seq, computed_blocks)

    def _allocate_window(self, seq: Sequence, computed_blocks: Seq[int]) -> None:
        """The window table after the main one: the hits' window blocks claimed, the blocks no
        query to come can see released, then new blocks up to the main table's length."""
        w = self.windowed
        assert w is not None
        first, claims, released = self._window_plan(seq, computed_blocks)
        table = seq.window_block_table
        if computed_blocks:
            assert not table
            table.extend([NO_BLOCK] * first)
            for block_id in claims:
                block = w.blocks[block_id]
                if block.ref_count == 0:
                    del w.free_block_queue[block_id]
                block.ref_count += 1
                table.append(block_id)
        self._release_window_before(table, first)
        while len(table) < len(seq.block_table):
            table.append(w._pop_free_block())

    def release_out_of_window(self, seq: Sequence) -> None:
        """After a step: free the window blocks no query still to come can see (they stay cached,
        if registered, until reallocated). Without a window pool, nothing."""
        if self.windowed is not None:
            self._release_window_before(
                seq.window_block_table, self.window_start_block(seq.num_computed_tokens)
            )

    def _release_window_before(self, table: list[int], first: int) -> None:
        """Release the window table's blocks before its entry `first`; their entries become NO_BLOCK."""
        assert self.windowed is not None
        for i in range(min(first, len(table))):
            if table[i] != NO_BLOCK:
                self.windowed._release(table[i])
                table[i] = NO_BLOCK

    def _release(self, block_id: int) -> None:
        """One holder fewer; at none the block joins the free queue, at its front if uncached."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_queue[block_id] = None
            if block.hash is None:
                self.free_block_queue.move_to_end(block_id, last=False)

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_block_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # eviction: the cached content is about to be overwritten
            if self.cached_block_ids.get(block.hash) == block_id:
                del self.cached_block_ids[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks. Its tail goes in first so, among equally old blocks, the
        tail (least likely to be shared) is evicted first; uncached blocks are recycled before any."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        if self.windowed is not None:
            for block_id in reversed(seq.window_block_table):
                if block_id != NO_BLOCK:
                    self.windowed._release(block_id)
            seq.window_block_table = []
        self._num_registered.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks of seq past those holding its first num_tokens positions (a rejected
        draft's): never registered in the cache, they are recycled first."""
        keep = self.num_blocks_for(num_tokens)
        assert keep >= self._num_registered.get(seq.seq_id, 0)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.hash is None and block.ref_count == 1, block
            block.ref_count = 0
            self.free_block_queue[block.block_id] = None
            self.free_block_queue.move_to_end(block.block_id, last=False)
        if self.windowed is not None:
            table = seq.window_block_table
            while len(table) > keep:
                block_id = table.pop()
                assert block_id != NO_BLOCK and self.windowed.blocks[block_id].hash is None
                self.windowed._release(block_id)

    def compute_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        return compute_slot_mapping(seq.block_table, self.block_size, start, end)

    def compute_window_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The windowed layers' slots of positions [start, end), all within blocks still held."""
        slots = compute_slot_mapping(seq.window_block_table, self.block_size, start, end)
        assert min(slots, default=0) >= 0, "a new position in a block that left the window"
        return slots

    def check_invariants(self) -> None:
        """Consistency of the pool; cheap enough for tests to call after every operation."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self.free_block_queue), block
        for h, block_id in self.cached_block_ids.items():
            assert self.blocks[block_id].hash == h
        assert len(self.free_block_queue) <= len(self.blocks)
        if self.windowed is not None:
            self.windowed.check_invariants()

    def check_holders(self, seqs: Seq[Sequence]) -> None:
        """Every block's ref_count is the number of tables among seqs holding it (the running and
        preempted sequences of a scheduler: all the holders), in both pools; a window table is as
        long as its main table, NO_BLOCK only before the window of the next query."""
        pools = [(self, "block_table")]
        if self.windowed is not None:
            pools.append((self.windowed, "window_block_table"))
        for pool, attr in pools:
            holders = [0] * len(pool.blocks)
            for seq in seqs:
                for block_id in getattr(seq, attr):
                    if block_id != NO_BLOCK:
                        holders[block_id] += 1
            assert holders == [b.ref_count for b in pool.blocks], (attr, holders)
        if self.windowed is not None:
            for seq in seqs:
                table = seq.window_block_table
                assert len(table) == len(seq.block_table), seq
                first = self.window_start_block(seq.num_computed_tokens)
                assert all(b != NO_BLOCK for b in table[first:]), (seq, table)
