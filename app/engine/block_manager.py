"""KV block pool: allocation, sharing by reference count, and reuse of full blocks by content hash.

A full block is identified by a chained SHA-256 (the previous block's hash, the adapter, its
tokens), so equal prefixes map to equal hash chains. Not Python's hash: it is 64 bits and, for
tuples of ints, not even salted, so a prompt could be built to collide with another user's prefix
and be handed that user's KV (vLLM moved to SHA-256 block hashes after such an advisory). Blocks whose last user is gone keep their contents and
hash in an LRU of free cached blocks until a new allocation needs the space:

    free_uncached  [blocks with nothing worth keeping]   <- taken first
    free_cached    [oldest ... newest]                    <- evicted from the oldest end
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from app.engine.sequence import Sequence

_ROOT = hashlib.sha256(b"kv-root").digest()


def block_hash(parent: bytes, tokens: list[int], adapter_key: str | None) -> bytes:
    adapter = (adapter_key or "").encode()
    digest = hashlib.sha256(parent)
    digest.update(len(adapter).to_bytes(4, "little") + adapter)  # length first: no two fields run together
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.reused_blocks_total = 0
        self.new_blocks_total = 0

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never taken
        from the cache: the step that computes it yields the logits to sample from. For the same
        reason a sequence that owes prompt logprobs or context logits takes none: they come from every
        prompt row's logits."""
        if not self.enable_reuse or seq.needs_prompt_rows:
            return []
        hits, parent = [], _ROOT
        for i in range((seq.num_tokens - 1) // self.block_size):
            parent = block_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size], seq.adapter_key)
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        return len(self._prefix_hits(seq)) * self.block_size

    def blocks_needed_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks a waiting sequence consumes to hold its first num_tokens (counted from
        position 0, cached prefix included): fresh ones plus cached hits now in the free list."""
        hits = self._prefix_hits(seq)
        # A hit sitting in the free list is counted as free, so taking it costs a free block too.
        hits_in_use = sum(1 for b in hits if self.ref_counts[b] > 0)
        return max(0, self.blocks_for(num_tokens) - hits_in_use)

    # -- allocation --------------------------------------------------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """First scheduling of a waiting sequence: take its cached prefix blocks."""
        assert not seq.block_table
        for block in self._prefix_hits(seq):
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(self.hash_of[block])
        seq.reused_blocks += len(seq.block_table)
        self.reused_blocks_total += len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold num_tokens tokens; all or nothing."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing <= 0:  # most calls: a decode inside its last block
            return True
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            seq.block_table.append(self._allocate_fresh())
        seq.new_blocks += missing
        self.new_blocks_total += missing
        return True

    def _allocate_fresh(self) -> int:
        if self.free_uncached:
            block = self.free_uncached.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)  # evict the least recently used
            del self.cached[self.hash_of[block]]
            self.hash_of[block] = None
        self.ref_counts[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_cached[block]
        self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; the tail goes first so that prefixes stay cached longest."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hash_of[block] is not None:
                    self.free_cached[block] = None
                else:
                    self.free_uncached.append(block)
        seq.block_table = []
        seq.block_hashes = []

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash blocks that the last step filled, so later requests can reuse them."""
        if not self.enable_reuse:
            return
        n_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), n_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT
            h = block_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size], seq.adapter_key)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached and self.hash_of[block] is None:
                self.cached[h] = block
                self.hash_of[block] = h

    def fork_needs_block(self, parent: Sequence) -> bool:
        return parent.num_computed_tokens % self.block_size != 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give child the parent's blocks: full ones shared, the partial last one copied (into a
        free block the caller made sure of). Returns (src, dst) for the KV copy the model runner
        must do, or None."""
        n_full = parent.num_computed_tokens // self.block_size
        copy = None
        if self.fork_needs_block(parent):
            copy = parent.block_table[n_full], self._allocate_fresh()
            child.new_blocks += 1
            self.new_blocks_total += 1
        shared = parent.block_table[:n_full]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared) + ([copy[1]] if copy else [])
        return copy
