"""kv_cache.py: paged blocks, block tables, positions -> slots, rollback, free, exhaustion, offload / restore."""
import pytest
import torch

from nano_sparsespec.kv_cache import BlockPool, KVCache, KVCacheFull

L, N_KV, D, BS = 2, 2, 8, 4


def make_cache(num_blocks=8, host_blocks=0, dtype=torch.float32):
    return KVCache(num_layers=L, num_kv_heads=N_KV, head_dim=D, num_blocks=num_blocks, block_size=BS,
                   dtype=dtype, device="cpu", host_blocks=host_blocks)


def all_blocks(cache):
    """Every device block exactly once, whether free or in a table."""
    used = [b for table in cache.pool.tables.values() for b in table]
    return sorted(used + list(cache.pool.free))


def test_shapes():
    cache = make_cache(num_blocks=5, host_blocks=3)
    assert cache.k.shape == cache.v.shape == (L, 6 * BS, N_KV, D)          # + the scratch block of padded steps
    assert cache.scratch_block == 5                                          # past every block: no request owns it
    assert cache.host_shape == (L, 3 * BS, N_KV, D) and cache.host_k is None   # made by the first offload
    assert cache.free_blocks() == 5
    with pytest.raises(ValueError, match="num_blocks=0"):
        make_cache(num_blocks=0)


def test_blocks_to_cover_counts_new_blocks_up_to_a_position():
    cache = make_cache()
    assert cache.blocks_to_cover(0, 0) == 0 and cache.blocks_to_cover(0, 1) == 1       # nothing cached yet
    cache.append(0, BS + 1)                                                           # 2 blocks
    assert [cache.blocks_to_cover(0, end) for end in (1, 2 * BS, 2 * BS + 1, 4 * BS)] == [0, 0, 1, 2]
    assert cache.blocks_to_cover(0, 2 * BS + 1) == cache.blocks_needed(0, BS)         # the same count, by position


def test_append_across_block_boundaries():
    cache = make_cache()
    cache.append(0, 3)                                          # 3 tokens: 1 block
    assert cache.length(0) == 3 and len(cache.pool.tables[0]) == 1
    assert cache.blocks_needed(0, 1) == 0 and cache.blocks_needed(0, 2) == 1 and cache.blocks_needed(0, 6) == 2
    cache.append(0, 1)                                          # exactly full
    assert cache.length(0) == 4 and len(cache.pool.tables[0]) == 1
    cache.append(0, 1)                                          # crosses into block 2
    assert cache.length(0) == 5 and len(cache.pool.tables[0]) == 2
    cache.append(0, 7)                                          # 12 tokens: 3 blocks
    assert cache.length(0) == 12 and len(cache.pool.tables[0]) == 3
    assert cache.free_blocks() == 8 - 3
    assert all_blocks(cache) == list(range(8))
    assert cache.length(42) == 0                                # unknown request: nothing cached


def test_reserve_covers_positions_up_to_an_end_and_never_shrinks():
    cache = make_cache(num_blocks=3)
    cache.reserve(0, 5)                                         # positions 0..4: 2 blocks
    assert cache.length(0) == 5 and len(cache.pool.tables[0]) == 2
    cache.reserve(0, 3)                                         # already held: nothing changes
    assert cache.length(0) == 5 and cache.free_blocks() == 1
    with pytest.raises(KVCacheFull, match="request 0 needs 2 more block"):
        cache.reserve(0, 4 * BS)
    assert cache.length(0) == 5 and cache.free_blocks() == 1   # a failed reserve takes nothing


def test_reserving_a_steps_requests_at_once_matches_one_at_a_time():
    # within the last block (length only), crossing into a new block, a new request, held already,
    # an end of 0 (nothing)
    ends = [(0, 6), (1, 9), (2, 3), (0, 5), (3, 0)]
    one_by_one, at_once = make_cache(), make_cache()
    for cache in (one_by_one, at_once):
        cache.append(0, 5)                                      # 2 blocks of 4: room for 8
        cache.append(1, 8)                                      # 2 blocks, full
    for seq_id, end in ends:                                    # through `append` (grow)
        if end > one_by_one.length(seq_id):
            one_by_one.append(seq_id, end - one_by_one.length(seq_id))
    at_once.reserve_each(ends)
    assert at_once.pool.lengths == one_by_one.pool.lengths == {0: 6, 1: 9, 2: 3}
    assert at_once.pool.tables == one_by_one.pool.tables
    assert [len(at_once.pool.tables[i]) for i in range(3)] == [2, 3, 1]


def test_block_tables_and_slots_of_interleaved_requests():
    cache = make_cache()
    cache.append(0, 5)          # request 0 takes blocks 0, 1
    cache.append(1, 2)          # request 1 takes block 2
    cache.append(0, 4)          # request 0 grows to 9 tokens: block 3
    cache.append(1, 3)          # request 1 grows to 5 tokens: block 4
    t0, t1 = cache.block_table(0).tolist(), cache.block_table(1).tolist()
    assert len(t0) == 3 and len(t1) == 2 and not set(t0) & set(t1)
    assert cache.block_table(0).dtype == torch.long

    for seq, table, n in ((0, t0, 9), (1, t1, 5)):
        positions = torch.arange(n)
        slots = cache.slots_of(seq, positions)
        expected = [table[p // BS] * BS + p % BS for p in range(n)]
        assert slots.tolist() == expected
        assert len(set(slots.tolist())) == n
    # arbitrary order and repeated positions map position by position
    assert cache.slots_of(0, torch.tensor([8, 0, 4, 4])).tolist() == [t0[2] * BS, t0[0] * BS, t0[1] * BS, t0[1] * BS]
    # no two requests ever share a slot
    s0 = set(cache.slots_of(0, torch.arange(9)).tolist())
    s1 = set(cache.slots_of(1, torch.arange(5)).tolist())
    assert not s0 & s1


def test_slots_index_the_pool():
    """Writing through slots_of and reading back by position recovers each request's own data."""
    cache = make_cache()
    cache.append(0, 6)
    cache.append(1, 7)
    cache.append(0, 3)
    data = {s: torch.randn(L, cache.length(s), N_KV, D) for s in (0, 1)}
    for s, x in data.items():
        cache.k[:, cache.slots_of(s, torch.arange(cache.length(s)))] = x
    for s, x in data.items():
        assert torch.equal(cache.k[:, cache.slots_of(s, torch.arange(cache.length(s)))], x)


def test_rollback_frees_only_emptied_blocks():
    cache = make_cache()
    cache.append(0, 10)                                        # 3 blocks (4 + 4 + 2)
    cache.append(1, 4)
    table = list(cache.pool.tables[0])
    free_before = cache.free_blocks()
    cache.rollback(0, 1)                                       # 9 tokens: still 3 blocks
    assert cache.length(0) == 9 and cache.pool.tables[0] == table and cache.free_blocks() == free_before
    cache.rollback(0, 1)                                       # 8 tokens: last block emptied
    assert cache.length(0) == 8 and cache.pool.tables[0] == table[:2]
    assert cache.free_blocks() == free_before + 1 and table[2] in cache.pool.free
    cache.rollback(0, 5)                                       # 3 tokens: 1 block
    assert cache.length(0) == 3 and cache.pool.tables[0] == table[:1]
    assert cache.free_blocks() == free_before + 2
    assert cache.slots_of(0, torch.arange(3)).tolist() == [table[0] * BS + i for i in range(3)]
    assert cache.length(1) == 4 and len(cache.pool.tables[1]) == 1   # the other request is untouched
    cache.rollback(0, 0)                                       # no-op
    assert cache.length(0) == 3 and cache.free_blocks() == free_before + 2
    cache.rollback(0, 3)                                       # everything
    assert cache.length(0) == 0 and cache.pool.tables[0] == []
    assert all_blocks(cache) == list(range(8))
    cache.append(0, 2)                                         # grows again from zero
    assert cache.length(0) == 2 and len(cache.pool.tables[0]) == 1


def test_rollback_then_append_keeps_kept_positions_in_place():
    cache = make_cache()
    cache.append(0, 7)
    kept = cache.slots_of(0, torch.arange(5)).tolist()
    cache.rollback(0, 2)
    cache.append(0, 6)
    assert cache.slots_of(0, torch.arange(5)).tolist() == kept


def test_rollback_too_many_raises():
    cache = make_cache()
    cache.append(3, 5)
    with pytest.raises(ValueError, match=r"roll back 6 token\(s\) of request 3, which has 5 cached"):
        cache.rollback(3, 6)
    with pytest.raises(ValueError, match="roll back -1"):
        cache.rollback(3, -1)
    assert cache.length(3) == 5 and len(cache.pool.tables[3]) == 2        # nothing changed


def test_free_returns_all_blocks_and_they_are_reused():
    cache = make_cache(num_blocks=4)
    cache.append(0, 9)                                          # 3 blocks
    cache.append(1, 3)                                          # the 4th
    assert cache.free_blocks() == 0
    blocks0 = set(cache.pool.tables[0])
    cache.free(0)
    assert cache.free_blocks() == 3 and 0 not in cache.pool.tables and cache.length(0) == 0
    cache.append(2, 12)                                         # needs exactly the 3 freed blocks
    assert set(cache.pool.tables[2]) == blocks0
    assert cache.free_blocks() == 0
    cache.free(1)
    cache.free(2)
    assert cache.free_blocks() == 4 and all_blocks(cache) == list(range(4))
    cache.free(99)                                              # unknown request: harmless
    assert cache.free_blocks() == 4


def test_exhaustion_raises_with_request_and_counts():
    cache = make_cache(num_blocks=3)
    cache.append(0, 8)                                          # 2 of 3 blocks
    with pytest.raises(KVCacheFull, match=r"device KV pool exhausted: request 7 needs 2 more block\(s\) of 4 "
                                          r"tokens, 1 of 3 free"):
        cache.append(7, 5)
    # the failed append changed nothing
    assert cache.free_blocks() == 1 and cache.length(7) == 0 and cache.pool.tables.get(7, []) == []
    cache.append(7, 4)                                          # what fits still fits
    assert cache.free_blocks() == 0
    with pytest.raises(KVCacheFull, match="request 0 needs 1 more"):
        cache.append(0, 1)
    assert cache.length(0) == 8
    assert issubclass(KVCacheFull, RuntimeError)


def test_block_pool_directly():
    pool = BlockPool(num_blocks=3, block_size=2, name="test")
    pool.grow(5, 3)
    assert pool.tables[5] == [0, 1] and pool.lengths[5] == 3
    pool.shrink(5, 2)
    assert pool.tables[5] == [0] and list(pool.free) == [2, 1]
    assert pool.release(5) == [0]
    assert sorted(pool.free) == [0, 1, 2] and 5 not in pool.lengths
    with pytest.raises(KVCacheFull, match="test KV pool exhausted: request 6"):
        pool.grow(6, 7)


# --------------------------------------------------------------------------------------------------------------------
# Offload / restore

def fill(cache, seq):
    slots = cache.slots_of(seq, torch.arange(cache.length(seq)))
    k = torch.randn(L, len(slots), N_KV, D, dtype=cache.k.dtype)
    v = torch.randn(L, len(slots), N_KV, D, dtype=cache.v.dtype)
    cache.k[:, slots] = k
    cache.v[:, slots] = v
    return k, v


def read(cache, seq):
    slots = cache.slots_of(seq, torch.arange(cache.length(seq)))
    return cache.k[:, slots], cache.v[:, slots]


@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_restore_is_byte_identical(chunk_blocks, dtype):
    torch.manual_seed(0)
    cache = make_cache(num_blocks=6, host_blocks=4, dtype=dtype)
    cache.append(0, 3)                                         # another request, sits in the middle
    cache.append(1, 11)                                        # 3 blocks
    k0, v0 = fill(cache, 0)
    k1, v1 = fill(cache, 1)
    old_table = list(cache.pool.tables[1])

    assert cache.host_k is None                                # the host pool: made by the first offload
    cache.offload(1, chunk_blocks=chunk_blocks)
    assert cache.host_k.shape == cache.host_v.shape == cache.host_shape
    assert cache.is_offloaded(1) and 1 not in cache.pool.tables
    assert cache.length(1) == 0 and cache.host_pool.lengths[1] == 11
    assert cache.free_blocks() == 5

    # someone else takes the freed blocks and scribbles on them
    cache.append(2, 20)                                        # all 5 free blocks
    assert set(old_table) <= set(cache.pool.tables[2])
    fill(cache, 2)
    cache.free(2)
    cache.append(3, 4)                                         # and keeps one block, so restore must move
    fill(cache, 3)

    cache.restore(1, chunk_blocks=chunk_blocks)
    assert not cache.is_offloaded(1) and cache.host_pool.free and len(cache.host_pool.free) == 4
    assert cache.length(1) == 11 and len(cache.pool.tables[1]) == 3
    assert cache.pool.tables[1] != old_table                   # landed (at least partly) in other blocks
    k1r, v1r = read(cache, 1)
    assert torch.equal(k1r, k1) and torch.equal(v1r, v1)
    k0r, v0r = read(cache, 0)                                  # the bystander is untouched
    assert torch.equal(k0r, k0) and torch.equal(v0r, v0)
    assert all_blocks(cache) == list(range(6))


def test_restored_request_keeps_working():
    cache = make_cache(num_blocks=4, host_blocks=4)
    cache.append(0, 6)
    k, _ = fill(cache, 0)
    cache.offload(0)
    cache.restore(0)
    cache.append(0, 3)                                         # grows into a new block
    assert cache.length(0) == 9 and len(cache.pool.tables[0]) == 3
    cache.rollback(0, 3)
    assert torch.equal(read(cache, 0)[0], k)
    cache.free(0)
    assert cache.free_blocks() == 4 and len(cache.host_pool.free) == 4


def test_free_of_an_offloaded_request_releases_host_blocks():
    cache = make_cache(num_blocks=4, host_blocks=3)
    cache.append(0, 9)
    cache.offload(0)
    assert len(cache.host_pool.free) == 0
    cache.free(0)
    assert len(cache.host_pool.free) == 3 and not cache.is_offloaded(0) and cache.free_blocks() == 4


def test_host_pool_exhaustion():
    cache = make_cache(num_blocks=6, host_blocks=2)
    cache.append(0, 5)                                        # 2 blocks
    cache.append(1, 9)                                        # 3 blocks
    k1, v1 = fill(cache, 1)
    cache.offload(0)
    with pytest.raises(KVCacheFull, match=r"host KV pool exhausted: request 1 needs 3 more block\(s\).*0 of 2 free"):
        cache.offload(1)
    # the failed offload left request 1 on the device, intact
    assert not cache.is_offloaded(1) and cache.length(1) == 9
    assert torch.equal(read(cache, 1)[0], k1) and torch.equal(read(cache, 1)[1], v1)


def test_no_host_pool_means_offload_fails_cleanly():
    cache = make_cache(num_blocks=2)
    cache.append(0, 3)
    with pytest.raises(KVCacheFull, match="host KV pool exhausted"):
        cache.offload(0)
    assert cache.length(0) == 3


def test_restore_without_room_raises_and_keeps_host_copy():
    cache = make_cache(num_blocks=3, host_blocks=3)
    cache.append(0, 8)
    k0, v0 = fill(cache, 0)
    cache.offload(0)
    cache.append(1, 12)                                       # the device is full now
    with pytest.raises(KVCacheFull, match="device KV pool exhausted: request 0"):
        cache.restore(0)
    assert cache.is_offloaded(0) and cache.host_pool.lengths[0] == 8
    cache.free(1)
    cache.restore(0)
    assert torch.equal(read(cache, 0)[0], k0) and torch.equal(read(cache, 0)[1], v0)
