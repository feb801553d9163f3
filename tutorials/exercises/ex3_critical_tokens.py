"""Exercise 3: PillarAttn's critical tokens, chosen from the verification's attention, with GQA averaging.

During verification every query row attends to the whole context anyway. PillarAttn keeps, for every layer and every
KV head, the positions that received the most attention, and lets the next k drafts attend only to those (plus the
tokens written since). With grouped-query attention (GQA) several query heads share one KV head, and a draft can only
gather K/V per *KV head*: so the score of a position for a KV head is the attention averaged over the query heads of
its group, and over the verification's query rows (weighted). Positions past the verified context (the rejected
drafts' columns) must never be chosen: their KV is about to be discarded.

Check your answer: python -m tutorials.check 3
(reference: nano_sparsespec.attention.dense_attention's scores, then pillar_attn.select_pillar; tutorial 02)
"""
import torch


def select_critical(probs: torch.Tensor, num_kv_heads: int, row_weight: torch.Tensor, context_len: int,
                    budget: int) -> torch.Tensor:
    """Top-`budget` positions per (layer, KV head).

    probs         Float[L, H, Q, N]  attention probabilities of the Q query rows over N positions, every layer and
                                     query head; query head h belongs to KV head h // (H // num_kv_heads)
    num_kv_heads  int
    row_weight    Float[Q]           weight of each query row in the average (they sum to 1)
    context_len   int                positions 0 .. context_len-1 stay in the cache; never choose a later one
    budget        int                positions to keep per (layer, KV head)
    returns Long[L, num_kv_heads, min(budget, context_len)]: for each (layer, KV head) the positions with the highest
      score[l, g, n] = mean over the heads h of group g of  sum_q row_weight[q] * probs[l, h, q, n].
      The order of positions within a row does not matter.
    """
    raise NotImplementedError("exercise 3: write select_critical")
