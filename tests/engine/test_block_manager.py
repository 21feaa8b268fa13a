"""BlockManager on its own: reference counts, prefix reuse by chained hash, LRU eviction, forks."""
from app.engine.block_manager import BlockManager
from app.engine.sampling_params import SamplingParams
from app.engine.sequence import Sequence


def _seq(tokens, seq_id=0, adapter=None):
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=4), frozenset(), None, adapter)


def _compute(bm, seq):
    """What a step does: slots for every token, all of them computed, full blocks registered."""
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_prefix_reuse_and_counters():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(10)))
    bm.allocate_cached_prefix(a)
    _compute(bm, a)
    assert len(a.block_table) == 3 and a.reused_blocks == 0 and a.new_blocks == 3
    b = _seq(list(range(8)) + [99, 98, 97], seq_id=1)
    bm.allocate_cached_prefix(b)
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    c = _seq(list(range(8)), seq_id=2)  # the last token is always recomputed: only one block is taken
    bm.allocate_cached_prefix(c)
    assert c.block_table == a.block_table[:1]
    assert bm.reused_blocks_total == 3


def test_adapter_is_part_of_the_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(9)))
    bm.allocate_cached_prefix(a)
    _compute(bm, a)
    other = _seq(list(range(9)), seq_id=1, adapter="sql")
    bm.allocate_cached_prefix(other)
    assert other.block_table == []


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(list(range(9)))
    bm.allocate_cached_prefix(a)
    _compute(bm, a)  # blocks: 2 full (hashed) + 1 partial
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.free_cached) == 2
    again = _seq(list(range(9)), seq_id=1)
    assert bm.blocks_needed_to_admit(again, 9) == 3  # cached hits in the free list still cost a free block
    bm.allocate_cached_prefix(again)
    assert again.num_computed_tokens == 8
    bm.free(again)
    # A newcomer needing every block evicts the cached ones, least recently used (the tail) first.
    big = _seq(list(range(100, 113)), seq_id=2)
    bm.allocate_cached_prefix(big)
    assert bm.ensure_slots(big, 13) and bm.num_free_blocks == 0 and not bm.cached


def test_ensure_slots_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = _seq(list(range(12)))
    assert not bm.ensure_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = _seq(list(range(6)))
    bm.allocate_cached_prefix(parent)
    _compute(bm, parent)
    child = parent.fork(1)
    src_dst = bm.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0] and bm.ref_counts[parent.block_table[0]] == 2
    assert src_dst == (parent.block_table[1], child.block_table[1])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
