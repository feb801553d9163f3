"""The paged dense kernel's work split on the H200: one layer's flex_attention over a random pool of the embedded
model's shape (3 KV heads x 64, 9 query heads, blocks of 64), as plain decoding (Q = 1) and verification (Q = 9)
see it.

flex_attention's decoding kernel runs a grid of (requests x KV heads) x SPLIT_KV. With the block mask listing `full`
blocks, each split takes a slice of the whole key sequence, here the pool: a request's blocks all fall in one split,
so a verification of 16 requests keeps 48 CTAs busy on 132 SMs. `pillar_attn.paged_block_mask(splits=S)` cuts each
request's context into S chunks that flex_attention sees as requests of their own, and `paged_attention` merges them
by their logsumexps. This measures S = 1 (the engine until this session) .. 8. Each variant runs 30 calls (one per
layer) in one CUDA graph, replayed (`graph_timing.replay_ms`; call 3 ran an inline copy of it that warmed up on the
default stream); its output is checked against S = 1's.
(Device calls 1 and 2 ran an earlier revision that listed every block as partial, so that flex_attention's own
SPLIT_KV divides each request's blocks: raw/flex_split_call{1,2}.txt; mask evaluation everywhere made that slower
than full blocks at 32 x Q = 9.)

Since session 13 the kernel runs with `pillar_attn.PAGED_KERNEL_OPTIONS` (two pipeline stages; the twelfth session's
figures had torch's default, one) and the random batch comes from benchmarks/h200/paged_batch.py.

Usage: python benchmarks/h200/session12/flex_split.py BATCH CONTEXT Q   (contexts spread over CONTEXT / 4 .. CONTEXT,
a random pool block per block)"""
import sys
from pathlib import Path

import torch

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import replay_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)
from paged_batch import G, BLOCK, random_paged_batch  # noqa: E402  (benchmarks/h200/paged_batch.py)

batch, context, Q = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
layers = 30
b = random_paged_batch(batch, context, Q)
q, k_pool, v_pool, lengths, kv_bytes = b.q, b.k_pool, b.v_pool, b.lengths, b.kv_bytes
attention = torch.compile(pillar_attn.paged_attention, dynamic=False)

print(f"batch {batch}, Q {Q}, contexts {int(lengths.min())}..{int(lengths.max())} (mean {lengths.float().mean():.0f}),"
      f" K+V read per call {kv_bytes / 1e6:.1f} MB")
reference = None
for splits in (1, 2, 3, 4, 6, 8):
    block_mask = pillar_attn.paged_block_mask(b.block_table, b.mask, b.q_start, b.q_valid, BLOCK, b.slots, G,
                                              splits=splits)
    out = attention(q, k_pool, v_pool, block_mask)
    if reference is None:
        reference = out
    error = (out.float() - reference.float()).abs().max().item()
    ms = replay_ms(lambda: [attention(q, k_pool, v_pool, block_mask) for _ in range(layers)]) / layers
    print(f"splits {splits}  {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e6:7.0f} GB/s  max |diff| {error:.2e}")
