"""The PillarAttn selection on the CPU: `pillar_attn.select_pillar` (a top-k of int64 keys since the sixteenth
session) against the stable descending sort it replaced, on random scores of 30 layers x 8 requests x 3 KV heads,
one thread; checks that both pick the same positions in the same order.

    PYTHONPATH=. python benchmarks/cpu/select_topk.py        # output: benchmarks/cpu/session16_select_topk.txt
"""
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def select_by_stable_sort(scores, context, budget):
    """`select_pillar` until the sixteenth session."""
    in_context = torch.arange(scores.shape[-1])[None, :] < torch.tensor(context)[:, None]          # [B, Lmax]
    masked = scores.masked_fill(~in_context[None, :, None, :], float("-inf"))
    order = masked.sort(dim=-1, descending=True, stable=True).indices[..., :max(budget)]
    return [order[:, b, :, :min(budget[b], context[b])] for b in range(len(context))]


def main():
    torch.set_num_threads(1)
    for positions in (1024, 2048, 4096):
        scores = torch.rand(30, 8, 3, positions).softmax(-1)                                    # [L, B, n_kv, Lmax]
        context = [positions - 10 * b for b in range(8)]
        budget = [max(128, positions // 20)] * 8
        same = all(torch.equal(a, b) for a, b in zip(select_by_stable_sort(scores, context, budget),
                                                     pillar_attn.select_pillar(scores, context, budget)))
        print(f"8 x {positions}: stable sort {ms(lambda: select_by_stable_sort(scores, context, budget)):.1f} ms, "
              f"top-k of keys {ms(lambda: pillar_attn.select_pillar(scores, context, budget)):.1f} ms, "
              f"same picks {same}")


if __name__ == "__main__":
    main()
