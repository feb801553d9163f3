"""Reference solution of exercise 3 (critical-token top-k with GQA averaging)."""
import torch


def select_critical(probs: torch.Tensor, num_kv_heads: int, row_weight: torch.Tensor, context_len: int,
                    budget: int) -> torch.Tensor:
    L, H, Q, N = probs.shape
    per_head = torch.einsum("lhqn,q->lhn", probs, row_weight)                 # [L, H, N] weighted over query rows
    scores = per_head.view(L, num_kv_heads, H // num_kv_heads, N).mean(2)     # [L, n_kv, N] averaged over the group
    scores = scores[..., :context_len]                                        # only positions that stay cached
    return scores.topk(min(budget, context_len), dim=-1).indices              # [L, n_kv, min(budget, context_len)]
