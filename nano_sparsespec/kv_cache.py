"""The paged KV cache: a device pool of fixed-size blocks, per-request block tables, a host pool.

Owns the K and V pools, `k` / `v` of shape [L, slots, n_kv, head_dim] with slot = block *
block_size + offset (a request's positions live in the blocks its table lists, so requests grow
and shrink without moving anyone else's KV), and the mechanics: `append`, `rollback` (rejected
drafts), `free`, `slots_of` (positions -> slots), `offload` / `restore` (to the host and back).

Must not compute attention, nor decide when to offload or which request leaves (the scheduler's).
"""
from __future__ import annotations

from collections import deque

import torch


class KVCacheFull(RuntimeError):
    """Raised when the device (or host) pool has no free block for a request."""


class BlockPool:
    """Free-list of block ids plus, per request, its block table and its cached positions."""

    def __init__(self, num_blocks: int, block_size: int, name: str):
        self.num_blocks, self.block_size, self.name = num_blocks, block_size, name
        self.free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        # requests whose table changed since a reader (the runner's mirror of the tables) last
        # took them out: most steps change few tables, so the reader need not compare them all
        self.changed: set[int] = set()

    def blocks_needed(self, seq_id: int, extra_tokens: int) -> int:
        """New blocks `seq_id` needs to hold `extra_tokens` more positions."""
        length = self.lengths.get(seq_id, 0) + extra_tokens
        return max(0, -(-length // self.block_size) - len(self.tables.get(seq_id, ())))

    def grow(self, seq_id: int, extra_tokens: int) -> None:
        """Add `extra_tokens` positions to `seq_id`, taking blocks as needed (KVCacheFull)."""
        need = self.blocks_needed(seq_id, extra_tokens)
        if need > len(self.free):
            raise KVCacheFull(f"{self.name} KV pool exhausted: request {seq_id} needs {need} more "
                              f"block(s) of {self.block_size} tokens, "
                              f"{len(self.free)} of {self.num_blocks} free")
        table = self.tables.setdefault(seq_id, [])
        if need:
            table.extend(self.free.popleft() for _ in range(need))
            self.changed.add(seq_id)
        self.lengths[seq_id] = self.lengths.get(seq_id, 0) + extra_tokens

    def shrink(self, seq_id: int, n_tokens: int) -> None:
        """Drop the last `n_tokens` positions of `seq_id`; emptied blocks go back free."""
        length = self.lengths[seq_id]
        if not 0 <= n_tokens <= length:
            raise ValueError(f"cannot roll back {n_tokens} token(s) of request {seq_id}, "
                             f"which has {length} cached")
        self.lengths[seq_id] = length - n_tokens
        keep = -(-self.lengths[seq_id] // self.block_size)
        table = self.tables[seq_id]
        if keep < len(table):
            self.free.extend(table[keep:])
            del table[keep:]
            self.changed.add(seq_id)

    def release(self, seq_id: int) -> list[int]:
        """Forget `seq_id` and return its blocks (in order) to the free list."""
        table = self.tables.pop(seq_id, [])
        self.lengths.pop(seq_id, None)
        self.changed.discard(seq_id)
        self.free.extend(table)
        return table


class KVCache:
    """Device pool (`k`, `v`) plus an optional host pool (`host_k`, `host_v`, pinned on CUDA,
    allocated by the first offload)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str,
                 host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.block_size, self.device = block_size, torch.device(device)
        # the scratch block, past the last, is never a request's: padded steps write there
        self.scratch_block = num_blocks
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)  # + scratch
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.pool = BlockPool(num_blocks, block_size, "device")
        # [L, host_blocks * block_size, n_kv, D], pinned on CUDA; made by the first offload:
        # pinning tens of GB takes tens of seconds, which a run that never offloads need not wait
        self.host_shape = (num_layers, host_blocks * block_size, num_kv_heads, head_dim)
        self.host_k: torch.Tensor | None = None
        self.host_v: torch.Tensor | None = None
        self.host_pool = BlockPool(host_blocks, block_size, "host")

    # --- bookkeeping ------------------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        """Cached positions of `seq_id` in the device pool."""
        return self.pool.lengths.get(seq_id, 0)

    def free_blocks(self) -> int:
        """Free blocks in the device pool."""
        return len(self.pool.free)

    def blocks_needed(self, seq_id: int, extra_tokens: int) -> int:
        """New device blocks `seq_id` needs to hold `extra_tokens` more positions."""
        return self.pool.blocks_needed(seq_id, extra_tokens)

    def blocks_to_cover(self, seq_id: int, end: int) -> int:
        """New device blocks `seq_id` needs for positions [0, end) to have slots."""
        return max(0, -(-end // self.block_size) - len(self.pool.tables.get(seq_id, ())))

    def append(self, seq_id: int, n_tokens: int) -> None:
        """Reserve slots for the next `n_tokens` positions of `seq_id` (attention writes the KV)."""
        self.pool.grow(seq_id, n_tokens)

    def reserve(self, seq_id: int, end: int) -> None:
        """Reserve slots up to position `end` (exclusive) of `seq_id`, if it holds fewer."""
        self.reserve_each([(seq_id, end)])

    def reserve_each(self, ends: list[tuple[int, int]]) -> None:
        """`reserve` for each (seq_id, end) of `ends`, in order: a step's requests in one call, most
        of them within their last block (no new block: only the length moves)."""
        lengths, tables = self.pool.lengths, self.pool.tables
        for seq_id, end in ends:
            length = lengths.get(seq_id, 0)
            if end <= length:
                continue
            if end <= len(tables.get(seq_id, ())) * self.block_size:
                lengths[seq_id] = end
            else:
                self.pool.grow(seq_id, end - length)

    def rollback(self, seq_id: int, n_tokens: int) -> None:
        """Forget the last `n_tokens` positions of `seq_id` (rejected drafts)."""
        self.pool.shrink(seq_id, n_tokens)

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id`, on the device and on the host."""
        self.pool.release(seq_id)
        self.host_pool.release(seq_id)

    # --- positions -> slots -----------------------------------------------------------------------
    def block_table(self, seq_id: int) -> torch.Tensor:
        """The device block ids of `seq_id`, in position order: [n_blocks] Long on the CPU."""
        return torch.tensor(self.pool.tables[seq_id], dtype=torch.long)

    def slots_of(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Slots [n] of positions [n] of one request, on the CPU."""
        table = self.block_table(seq_id)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    # --- offload / restore ------------------------------------------------------------------------
    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        """All slots of `blocks`, in order: [len(blocks) * block_size]."""
        ids = torch.tensor(blocks, dtype=torch.long)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size)).flatten()

    def offload(self, seq_id: int, chunk_blocks: int = 64) -> None:
        """Move every block of `seq_id` to the host pool, in chunks; free its device blocks."""
        if self.host_k is None:      # (a block is read back only after an offload wrote it)
            pin = self.device.type == "cuda"
            self.host_k, self.host_v = (torch.empty(self.host_shape, dtype=self.k.dtype,
                                                    pin_memory=pin) for _ in range(2))
        self._move(seq_id, self.pool, self.host_pool, (self.k, self.v), (self.host_k, self.host_v),
                   chunk_blocks)

    def restore(self, seq_id: int, chunk_blocks: int = 64) -> None:
        """Bring an offloaded request back into (maybe different) device blocks, byte for byte."""
        self._move(seq_id, self.host_pool, self.pool, (self.host_k, self.host_v), (self.k, self.v),
                   chunk_blocks)

    def _move(self, seq_id, src_pool, dst_pool, src_kv, dst_kv, chunk_blocks: int) -> None:
        """Copy `seq_id`'s KV from `src_kv` into new `dst_pool` blocks of `dst_kv`, in chunks."""
        dst_pool.grow(seq_id, src_pool.lengths[seq_id])
        src, dst = src_pool.tables[seq_id], dst_pool.tables[seq_id]
        for i in range(0, len(src), chunk_blocks):
            s = self._block_slots(src[i:i + chunk_blocks]).to(src_kv[0].device)
            d = self._block_slots(dst[i:i + chunk_blocks]).to(dst_kv[0].device)
            for src_t, dst_t in zip(src_kv, dst_kv):  # K, then V
                dst_t[:, d] = src_t[:, s].to(dst_t.device)
        src_pool.release(seq_id)

    def is_offloaded(self, seq_id: int) -> bool:
        """True while `seq_id`'s KV lives in the host pool."""
        return seq_id in self.host_pool.tables
