"""Dense decode attention at batch x context on the embedded model's attention shape (9 heads, 3 KV heads, head_dim
64), one layer, random pool: how the gather layout feeds SDPA, and what the score pass costs.

  slot-major   gather whole slots (n_kv x D per index) -> [B, L, n_kv, D], SDPA on its transposed view
  head-major   gather (slot, head) rows (D per index) -> [B, n_kv, L, D] (what pillar_attn does since session 2)
  block-major  gather whole 16-slot blocks by block table -> [B, L, n_kv, D], SDPA on its transposed view
Each: gather, SDPA (Q = 1 and Q = 9 with a causal tail), and the top CUDA kernels of one call.
Usage: python benchmarks/h200/session3/dense_gather.py BATCH CONTEXT [DEVICE]"""
import sys
import time

import torch
import torch.nn.functional as F

from nano_sparsespec.pillar_attn import pillar_scores

B, L = int(sys.argv[1]), int(sys.argv[2])
H, n_kv, D, block = 9, 3, 64, 16
dev = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda")
dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
nb = L // block
num_blocks = B * nb
pool = torch.randn(num_blocks * block, n_kv, D, device=dev, dtype=dt)          # [slots, n_kv, D]
table = torch.randperm(num_blocks, device=dev).view(B, nb)                      # [B, nb] block table
slots = (table[:, :, None] * block + torch.arange(block, device=dev)).view(B, L)  # [B, L]
heads = torch.arange(n_kv, device=dev)[None, :, None]
head_index = slots[:, None, :] * n_kv + heads                                   # [B, n_kv, L]


def timed(fn, reps=20):
    fn(); sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps * 1e3


gathers = {
    "slot-major": lambda: pool.view(-1, n_kv * D)[slots].view(B, L, n_kv, D).transpose(1, 2),
    "head-major": lambda: pool.view(-1, D)[head_index],
    "block-major": lambda: pool.view(num_blocks, -1)[table].view(B, L, n_kv, D).transpose(1, 2),
}
for Q in (1, 9):
    q = torch.randn(B, H, Q, D, device=dev, dtype=dt)
    mask = torch.ones(B, 1, Q, L, dtype=torch.bool, device=dev)
    mask[:, :, :, L - Q:] = torch.ones(Q, Q, dtype=torch.bool, device=dev).tril()
    for name, gather in gathers.items():
        k = gather()
        kv_bytes = 2 * k.numel() * k.element_size()
        t_gather = timed(gather)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
        t_sdpa = timed(sdpa)
        line = (f"Q={Q} {name:11s} gather K {t_gather:6.3f} ms ({kv_bytes / 2 / t_gather / 1e6:6.0f} GB/s written), "
                f"SDPA {t_sdpa:6.3f} ms ({kv_bytes / t_sdpa / 1e6:6.0f} GB/s of K+V)")
        if Q > 1:
            kq = k.transpose(1, 2)                                              # [B, L, n_kv, D] as pillar_scores takes
            w = torch.full((B, Q), 1.0 / Q, device=dev)
            line += f", scores {timed(lambda: pillar_scores(q.transpose(1, 2), kq, mask[:, 0], w)):6.3f} ms"
        print(line, flush=True)
        if dev.type != "cuda":
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gather(); sdpa(); sync()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:3]:
            print(f"      {e.device_time_total / 1e3:7.3f} ms  {e.key[:90]}")
