"""Reference solution of exercise 6 (sparse attention over the selected positions, with GQA)."""
import torch


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    H, D = q.shape
    n_kv = k.shape[1]
    heads = torch.arange(n_kv)[:, None]                                       # [n_kv, 1]
    keys, values = k[selected, heads], v[selected, heads]                     # [n_kv, B, D] gathered per KV head
    queries = q.view(n_kv, H // n_kv, D)                                      # [n_kv, G, D] query heads by group
    logits = queries @ keys.transpose(1, 2) * D ** -0.5                       # [n_kv, G, B]
    return (logits.softmax(-1) @ values).reshape(H, D)                        # [n_heads, D]
