"""A verification's attention with its PillarAttn scores on the CPU, one layer, eager: `pillar_attn.dense_attention`
with score weights (since the seventeenth session the output comes from the explicit probabilities the scores need,
probabilities x V) against the form it replaced (torch's fused SDPA for the output, then `pillar_scores`, which
computes the logits a second time); random inputs of BATCH requests x CONTEXT positions, k + 1 = 9 query rows, the
embedded model's heads (9 query, 3 KV, 64 wide), one thread.

    PYTHONPATH=. python benchmarks/cpu/scored_attention.py [BATCH] [CONTEXT]     # default 8 4096; output:
                                                                                 # benchmarks/cpu/session17_scored_attention.txt
"""
import sys
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def sdpa_then_scores(q, k, v, mask, score_weight):
    """`dense_attention` with scores until the seventeenth session."""
    out, _ = pillar_attn.dense_attention(q, k, v, mask)
    return out, pillar_attn.pillar_scores(q, k, mask, score_weight)


def main():
    batch, context = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (8, 4096)))
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(batch, 9, 9, 64, generator=g).to(dtype)                         # [B, Q, n_heads, D]
        k, v = (torch.randn(batch, context, 3, 64, generator=g).to(dtype) for _ in range(2))   # [B, L, n_kv, D]
        mask = torch.ones(batch, 9, context, dtype=torch.bool)
        mask[:, :, context - 100:] = False                                              # padding past the context
        weight = torch.full((batch, 9), 1 / 9)
        (out, scores), (ref_out, ref_scores) = (pillar_attn.dense_attention(q, k, v, mask, weight),
                                                sdpa_then_scores(q, k, v, mask, weight))
        print(f"{batch} x {context}, {dtype}, ms per layer: probabilities x V (dense_attention) "
              f"{ms(lambda: pillar_attn.dense_attention(q, k, v, mask, weight)):.1f}, SDPA + pillar_scores "
              f"{ms(lambda: sdpa_then_scores(q, k, v, mask, weight)):.1f} (SDPA alone "
              f"{ms(lambda: pillar_attn.dense_attention(q, k, v, mask)):.1f}); max |difference| output "
              f"{float((out.float() - ref_out.float()).abs().max()):.1e}, scores "
              f"{float((scores - ref_scores).abs().max()):.1e}")


if __name__ == "__main__":
    main()
