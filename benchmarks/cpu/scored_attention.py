"""A verification's attention with its PillarAttn scores on the CPU, one layer, eager: `pillar_attn.dense_attention`
with score weights (since the seventeenth session the output comes from the explicit probabilities the scores need,
probabilities x V, their logits in float32) against the form it replaced (torch's fused SDPA for the output, then
`pillar_scores`, which computes the logits a second time) and against the first form of the change (76eefbc: logits
in the inputs' dtype); each output's error against a float64 reference. Random inputs of BATCH requests x CONTEXT
positions, k + 1 = 9 query rows, the embedded model's heads (9 query, 3 KV, 64 wide), one thread.

    PYTHONPATH=. python benchmarks/cpu/scored_attention.py [BATCH] [CONTEXT]     # default 8 4096

Output: benchmarks/cpu/session17_scored_attention.txt (8 4096, then 8 1024).
"""
import sys
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def sdpa_then_scores(q, k, v, mask, score_weight):
    """`dense_attention` with scores until the seventeenth session."""
    out, _ = pillar_attn.dense_attention(q, k, v, mask)
    return out, pillar_attn.pillar_scores(q, k, mask, score_weight)


def logits_in_input_dtype(q, k, v, mask, score_weight):
    """`dense_attention` with scores at 76eefbc: the logits' matmul rounds them to the inputs' dtype."""
    probs = pillar_attn.attention_probs(q, k, mask)                                    # [B, n_kv, G, Q, L]
    B, n_kv, _, Q, L = probs.shape
    packed_probs = probs.to(v.dtype).view(B, n_kv, -1, L)
    out = torch.stack([torch.bmm(packed_probs[:, h], v[:, :, h]) for h in range(n_kv)], dim=1)
    return pillar_attn._unpack_groups(out, Q), pillar_attn.weighted_scores(probs, score_weight)


def main():
    batch, context = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (8, 4096)))
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 9, 9, 64, generator=g) * 2                                  # [B, Q, n_heads, D]
    k = torch.randn(batch, context, 3, 64, generator=g) * 2                            # [B, L, n_kv, D]
    v = torch.randn(batch, context, 3, 64, generator=g)
    mask = torch.ones(batch, 9, context, dtype=torch.bool)
    mask[:, :, context - 100:] = False                                                  # padding past the context
    weight = torch.full((batch, 9), 1 / 9)
    reference, _ = pillar_attn.dense_attention(q.double(), k.double(), v.double(), mask)
    forms = {"probabilities x V (dense_attention)": pillar_attn.dense_attention,
             "SDPA + pillar_scores": sdpa_then_scores,
             "logits in the inputs' dtype (76eefbc)": logits_in_input_dtype}
    for dtype in (torch.bfloat16, torch.float32):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), mask, weight)
        print(f"{batch} x {context}, {dtype}, one layer:")
        for name, form in forms.items():
            error = (form(*args)[0].double() - reference).abs()
            print(f"  {name:40s} {ms(lambda: form(*args)):6.1f} ms, output error max {float(error.max()):.1e} "
                  f"mean {float(error.mean()):.1e}")


if __name__ == "__main__":
    main()
