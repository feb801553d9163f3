"""Exercise 7: rolling a request's KV back after a rejection.

A verification writes the KV of the pending token and of every draft it checks. When the verifier rejects the last
drafts, the KV of their positions belongs to tokens that will never be emitted: the cache must forget those positions,
so that the next step writes the right tokens' KV there.

The paged KV cache (kv_cache.py) stores a request's positions in fixed-size blocks of a shared pool. Its block table
lists the blocks in position order: the first block_size positions fill the first block, the next block_size the
second, and so on; only the last block may be partly filled, and the table holds no block without a position. Blocks
that no longer hold any position of the request go back to the pool's free list, where any request can take them;
a block that still holds at least one position stays in the table (its freed slots will simply be written again).

Check your answer: python -m tutorials.check 7
(reference: nano_sparsespec.kv_cache.BlockPool.shrink, which KVCache.rollback calls)
"""


def rollback(block_table: list[int], length: int, block_size: int, n_rejected: int) -> tuple[int, list[int], list[int]]:
    """Forget the last `n_rejected` cached positions of one request.

    block_table  the request's block ids, in position order, as many as its `length` positions need
    length       positions cached
    block_size   positions per block
    n_rejected   positions to forget (the rejected drafts' KV)
    returns (new_length, kept, freed): the positions still cached, the block table afterwards, and the blocks that go
      back to the free list, in the order the table listed them.
    Raises ValueError when n_rejected is not a possible number of positions to forget. Leaves block_table unchanged.
    """
    raise NotImplementedError("exercise 7: write rollback")
