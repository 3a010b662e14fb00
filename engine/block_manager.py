"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, automatic prefix caching.

A full block is keyed by a hash chained over (parent block hash, its token ids, adapter id, cache
salt), so two sequences share a block only when everything before it matches too. Freed blocks keep
their content and hash in an LRU free queue; a cached block is forgotten only when reallocated.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from engine.sequence import Sequence

_NO_PARENT = b"\x00" * 32


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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
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
        return hits

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
        return self._num_blocks_needed(seq, num_new_tokens, computed_blocks) <= self.num_free_blocks - revived

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
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id} by seq {seq.seq_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
                if block.hash is None:
                    self.free_block_queue.move_to_end(block_id, last=False)
        seq.block_table = []
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

    def compute_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        return compute_slot_mapping(seq.block_table, self.block_size, start, end)

    def check_invariants(self) -> None:
        """Consistency of the pool; cheap enough for tests to call after every operation."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self.free_block_queue), block
        for h, block_id in self.cached_block_ids.items():
            assert self.blocks[block_id].hash == h
        assert len(self.free_block_queue) <= len(self.blocks)
