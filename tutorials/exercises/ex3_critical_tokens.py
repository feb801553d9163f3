"""Exercise 3: PillarAttn's critical tokens, chosen from the verification's attention, with GQA averaging.

During verification every query row attends to the whole context anyway. PillarAttn keeps, for every layer and every
KV head, the positions that received the most attention, and lets the next k drafts attend only to those (plus the
tokens written since). With grouped-query attention (GQA) several query heads share one KV head, and a draft can only
fetch K/V per *KV head*: the attention a position received counts for the KV head of the query heads that paid it,
each query head of the group counting equally, and each query row of the verification counting by its weight.
Positions past the verified context (the rejected drafts' columns) must never be chosen: their KV is about to be
discarded.

Query heads are numbered group by group: with G = H / num_kv_heads, the first G query heads share KV head 0, the
next G KV head 1, and so on.

Check your answer: python -m tutorials.check 3
(reference: nano_sparsespec.pillar_attn.pillar_scores, then pillar_attn.select_pillar; tutorial 03)
"""
import torch


def select_critical(probs: torch.Tensor, num_kv_heads: int, row_weight: torch.Tensor, context_len: int,
                    budget: int) -> torch.Tensor:
    """The `budget` most-attended positions per (layer, KV head).

    probs         Float[L, H, Q, N]  attention probabilities of the Q query rows over N positions, every layer and
                                     query head
    num_kv_heads  int
    row_weight    Float[Q]           how much each query row counts (the weights sum to 1)
    context_len   int                positions 0 .. context_len-1 stay in the cache; never choose a later one
    budget        int                positions to keep per (layer, KV head)
    returns Long[L, num_kv_heads, min(budget, context_len)]: for each layer and KV head, the positions of the verified
      context that its group of query heads attended to most, the query rows weighted by row_weight and the group's
      query heads counting equally. The order of positions within a row does not matter.
    """
    raise NotImplementedError("exercise 3: write select_critical")
