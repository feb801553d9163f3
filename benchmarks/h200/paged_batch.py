"""A random batch for one layer of the paged kernel, in the embedded model's attention shape (3 KV heads x 64, 9 query
heads, pool blocks of 64): what session12/flex_split.py and session13/flex_options.py time."""
from types import SimpleNamespace

import torch

N_KV, G, D, BLOCK = 3, 3, 64, 64


def random_paged_batch(batch: int, context: int, Q: int, device="cuda", dtype=torch.bfloat16) -> SimpleNamespace:
    """`batch` requests whose contexts (this step's Q query rows included) are spread over context / 4 .. context, each
    of their blocks a random block of a pool that holds them all. Fields: q [B, Q, N_KV * G, D], k_pool, v_pool
    [slots, N_KV, D], block_table [B, nb], q_start [B], q_valid [B, Q], mask [B, Q, nb * BLOCK] (causal), slots,
    lengths [B] (CPU), kv_bytes (K + V bytes the batch's attention reads)."""
    torch.manual_seed(0)
    lengths = torch.randint(context // 4, context + 1, (batch,))
    nb = -(-context // BLOCK)
    pool_blocks = batch * nb + 1
    slots = pool_blocks * BLOCK
    k_pool = torch.randn(slots, N_KV, D, device=device, dtype=dtype)
    v_pool = torch.randn(slots, N_KV, D, device=device, dtype=dtype)
    block_table = torch.randperm(pool_blocks - 1)[:batch * nb].view(batch, nb).to(device)
    q = torch.randn(batch, Q, N_KV * G, D, device=device, dtype=dtype)
    q_start = (lengths - Q).to(device)
    q_valid = torch.ones(batch, Q, dtype=torch.bool, device=device)
    kv_pos = torch.arange(nb * BLOCK, device=device)[None, None, :]
    mask = kv_pos <= (q_start[:, None] + torch.arange(Q, device=device))[:, :, None]   # [B, Q, L]
    kv_bytes = int(lengths.sum()) * N_KV * D * 2 * k_pool.element_size()
    return SimpleNamespace(q=q, k_pool=k_pool, v_pool=v_pool, block_table=block_table, q_start=q_start,
                           q_valid=q_valid, mask=mask, slots=slots, lengths=lengths, kv_bytes=kv_bytes)


def from_command_line(Q: int) -> SimpleNamespace:
    """The batch a script's command line `BATCH CONTEXT [cuda|cpu]` asks for (bf16 on the GPU, float32 on the CPU),
    with `device` set on it."""
    import sys
    batch, context = int(sys.argv[1]), int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] in ("cuda", "cpu") else "cuda"
    b = random_paged_batch(batch, context, Q, device=device,
                           dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    b.device = device
    return b
