"""The paged KV cache: a device pool of fixed-size blocks, per-request block tables, a host pool.

Owns
  * the K and V pools, `k[layer]` / `v[layer]` of shape [num_slots, n_kv, head_dim] where
    slot = block * block_size + offset: a request's positions live in whatever blocks its block
    table lists, so requests grow and shrink without moving anyone else's KV;
  * the mechanics: `append` (reserve slots for new positions), `rollback` (forget the last n
    positions: rejected drafts), `free`, `slots_of` (positions -> slots), and `offload` /
    `restore` (move a whole request's blocks to the host pool and back, in chunks of blocks, byte
    for byte).

Must not decide *when* to offload or which request leaves: that policy is the scheduler's.
Must not compute attention.
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
        table.extend(self.free.popleft() for _ in range(need))
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
        self.free.extend(table[keep:])
        del table[keep:]

    def release(self, seq_id: int) -> list[int]:
        """Forget `seq_id` and return its blocks (in order) to the free list."""
        table = self.tables.pop(seq_id, [])
        self.lengths.pop(seq_id, None)
        self.free.extend(table)
        return table


class KVCache:
    """Device pool (`k`, `v`) plus an optional host pool (`host_k`, `host_v`, pinned on CUDA).

    Both pools have the layout [L, slots, n_kv, head_dim]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str,
                 host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.block_size = block_size
        self.device = torch.device(device)
        # One block past the last is the scratch block, never handed to a request: padded steps
        # (CUDA graphs) write and read its first slot, the scratch slot.
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        # [L, slots + block, n_kv, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks, block_size, "device")
        host_shape = (num_layers, host_blocks * block_size, num_kv_heads, head_dim)
        pin = self.device.type == "cuda"
        self.host_k = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
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

    def append(self, seq_id: int, n_tokens: int) -> None:
        """Reserve slots for the next `n_tokens` positions of `seq_id` (attention writes the KV)."""
        self.pool.grow(seq_id, n_tokens)

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
        length = self.pool.lengths[seq_id]
        self.host_pool.grow(seq_id, length)
        src, dst = self.pool.tables[seq_id], self.host_pool.tables[seq_id]
        for i in range(0, len(src), chunk_blocks):
            s = self._block_slots(src[i:i + chunk_blocks]).to(self.device)
            d = self._block_slots(dst[i:i + chunk_blocks])
            self.host_k[:, d] = self.k[:, s].cpu()
            self.host_v[:, d] = self.v[:, s].cpu()
        self.pool.release(seq_id)

    def restore(self, seq_id: int, chunk_blocks: int = 64) -> None:
        """Bring an offloaded request back into (maybe different) device blocks, byte for byte."""
        length = self.host_pool.lengths[seq_id]
        self.pool.grow(seq_id, length)
        src, dst = self.host_pool.tables[seq_id], self.pool.tables[seq_id]
        for i in range(0, len(src), chunk_blocks):
            s = self._block_slots(src[i:i + chunk_blocks])
            d = self._block_slots(dst[i:i + chunk_blocks]).to(self.device)
            self.k[:, d] = self.host_k[:, s].to(self.device)
            self.v[:, d] = self.host_v[:, s].to(self.device)
        self.host_pool.release(seq_id)

    def is_offloaded(self, seq_id: int) -> bool:
        """True while `seq_id`'s KV lives in the host pool."""
        return seq_id in self.host_pool.tables
