"""The PillarAttn score pass on the CPU, one layer, eager: `pillar_attn.pillar_scores` (torch's fused softmax since
the sixteenth session) against the form it replaced (exp(logit - logsumexp), the logsumexp making passes of its own),
and the logits alone; random inputs of BATCH requests x CONTEXT positions, k + 1 = 9 query rows, the embedded model's
heads (9 query, 3 KV, 64 wide), one thread.

    PYTHONPATH=. python benchmarks/cpu/score_forms.py [BATCH] [CONTEXT]     # default 8 4096; output:
                                                                            # benchmarks/cpu/session16_score_forms.txt
"""
import sys
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def scores_by_logsumexp(q, k, mask, score_weight):
    """`pillar_scores` until the sixteenth session."""
    logits = pillar_attn.attention_logits(q, k, mask)                                  # [B, n_kv, G, Q, L]
    lse = logits.logsumexp(dim=-1, keepdim=True)
    weight = score_weight.float()[:, None, None, :, None] / logits.shape[2]
    return (torch.exp(logits - lse) * weight).sum(dim=(2, 3))


def main():
    batch, context = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (8, 4096)))
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(batch, 9, 9, 64, generator=g).to(dtype)                         # [B, Q, n_heads, D]
        k = torch.randn(batch, context, 3, 64, generator=g).to(dtype)                   # [B, L, n_kv, D]
        mask = torch.ones(batch, 9, context, dtype=torch.bool)
        mask[:, :, context - 100:] = False                                              # padding past the context
        weight = torch.full((batch, 9), 1 / 9)
        diff = (pillar_attn.pillar_scores(q, k, mask, weight) - scores_by_logsumexp(q, k, mask, weight)).abs().max()
        print(f"{batch} x {context}, {dtype}, ms per layer: softmax (pillar_scores) "
              f"{ms(lambda: pillar_attn.pillar_scores(q, k, mask, weight)):.1f}, exp(logit - logsumexp) "
              f"{ms(lambda: scores_by_logsumexp(q, k, mask, weight)):.1f}, the logits alone "
              f"{ms(lambda: pillar_attn.attention_logits(q, k, mask)):.1f}; max |difference| {float(diff):.1e}")


if __name__ == "__main__":
    main()
