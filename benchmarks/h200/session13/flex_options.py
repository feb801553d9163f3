"""The paged kernel's Triton settings on the H200: one layer's flex_attention decoding kernel (as
`pillar_attn.paged_attention` calls it, contexts cut by `PAGED_CHUNK`) under each (num_stages, num_warps, BLOCK_N).

torch's default for the decoding kernel on sm_90 is (BLOCK_N 64, num_stages 1, num_warps 2) in the version read on the
CPU machine (2.13: a branch for sm_90 picks 3 stages, the `else` of the next `if` sets 1 again): one stage does not
overlap a block's loads with the previous block's math, and a plain step's attention read K/V at ~1.8 TB/s (session
12). Same random pool and shapes as session12/flex_split.py; each setting runs 30 calls in one CUDA graph; outputs are
checked against the default's.

Usage: python benchmarks/h200/session13/flex_options.py [BATCH:CONTEXT:Q ...]   (default: the engine's shapes)"""
import itertools
import sys
from pathlib import Path

import torch

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import replay_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)
from paged_batch import G, BLOCK, random_paged_batch  # noqa: E402  (benchmarks/h200/paged_batch.py)

layers = 30
SETTINGS = [None] + [dict(num_stages=s, num_warps=w) for s, w in itertools.product((2, 3, 4), (2, 4))]
# (call 3 also tried BLOCK_N 32 at 1 and 2 stages: slower than 64 but for 1 stage and 2 warps, 43.4 against 47.1 us)
torch._dynamo.config.recompile_limit = 1000       # one compilation per setting and shape


def shape(batch: int, context: int, Q: int):
    b = random_paged_batch(batch, context, Q)
    nb = b.block_table.shape[1]
    splits = -(-nb // max(1, pillar_attn.PAGED_CHUNK // BLOCK))
    block_mask = pillar_attn.paged_block_mask(b.block_table, b.mask, b.q_start, b.q_valid, BLOCK, b.slots, G,
                                              splits=splits)
    q, k_pool, v_pool, lengths, kv_bytes = b.q, b.k_pool, b.v_pool, b.lengths, b.kv_bytes
    print(f"## batch {batch}, Q {Q}, contexts {int(lengths.min())}..{int(lengths.max())}, splits {splits}, "
          f"K+V per call {kv_bytes / 1e6:.1f} MB", flush=True)
    reference, results = None, []
    for options in SETTINGS:
        attention = torch.compile(lambda q, k, v, m, o=options: pillar_attn.paged_attention(q, k, v, m, o or {}),
                                  dynamic=False)
        try:
            out = attention(q, k_pool, v_pool, block_mask)
        except Exception as e:                                     # a setting Triton cannot build (shared memory)
            print(f"{str(options):55s} failed: {type(e).__name__}", flush=True)
            continue
        reference = out if reference is None else reference
        error = (out.float() - reference.float()).abs().max().item()
        ms = replay_ms(lambda: [attention(q, k_pool, v_pool, block_mask) for _ in range(layers)]) / layers
        results.append((ms, options))
        print(f"{str(options or 'default'):55s} {ms * 1e3:7.1f} us {kv_bytes / ms / 1e6:6.0f} GB/s "
              f"max |diff| {error:.1e}", flush=True)
    best = min(results, key=lambda r: r[0])
    print(f"best: {best[1]} {best[0] * 1e3:.1f} us against default {results[0][0] * 1e3:.1f} us\n", flush=True)


for spec in sys.argv[1:] or ["128:1300:1", "128:2300:1", "16:1250:9", "32:1250:9"]:
    shape(*map(int, spec.split(":")))
