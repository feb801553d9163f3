"""The copy into the draft buffers on the CPU (one thread, bfloat16, the embedded model's layers): rows of D read from
the KV pool and written into buffer rows, indexed by (layer, row) pairs (the twenty-first session's
`fill_draft_buffers`) and through one flat row index each way (`index_select` / `index_copy_`, the twenty-second's).

    PYTHONPATH=. python benchmarks/cpu/fill_copy.py

Twenty-second session: benchmarks/cpu/session22_fill.txt.
"""
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def by_index_pairs(k_cache, v_cache, draft_k, draft_v, block_table, block_size, positions, rows, columns):
    """The twenty-first session's copy (6f277d2): rows of D indexed by (layer, row) pairs."""
    L, _, n_kv, D = k_cache.shape
    C = draft_k.shape[-2]
    slots = block_table.gather(1, (positions // block_size).flatten(1)).view_as(positions) * block_size \
        + positions % block_size
    heads = torch.arange(n_kv)[:, None]
    source = (slots * n_kv + heads).transpose(0, 1).reshape(L, -1)
    target = ((rows[:, None, None] * n_kv + heads) * C + columns[:, None, :]).view(1, -1)
    layers = torch.arange(L)[:, None]
    for cache, buffer in ((k_cache, draft_k), (v_cache, draft_v)):
        buffer.view(L, -1, D)[layers, target] = cache.view(L, -1, D)[layers, source]


def main():
    torch.set_num_threads(1)
    L, n_kv, D, block_size, batch, context = 30, 3, 64, 16, 8, 1200
    k_cache, v_cache = (torch.randn(L, batch * context, n_kv, D, dtype=torch.bfloat16) for _ in range(2))
    block_table = torch.arange(batch * context // block_size).view(batch, -1)
    C = 152
    draft_k, draft_v = (torch.zeros(L, batch + 1, n_kv, C, D, dtype=torch.bfloat16) for _ in range(2))
    print(f"pool: {batch} requests x {context} positions, {L} layers, {n_kv} KV heads, head_dim {D}; ms per call")
    print("| copy | rows of D | by (layer, row) pairs | by flat rows |")
    print("|---|---:|---:|---:|")
    for name, B, n in (("a verification's selection (1 request, 128 positions)", 1, 128),
                       ("a draft step's lookups (8 drafts, 16 positions)", 8, 16)):
        positions = torch.randint(0, context - 100, (B, L, n_kv, n))
        rows, columns = torch.arange(B), torch.arange(n).expand(B, -1)
        args = (k_cache, v_cache, draft_k, draft_v, block_table[:B], block_size, positions, rows, columns)
        times = [ms(lambda: by_index_pairs(*args), 50), ms(lambda: pillar_attn.fill_draft_buffers(*args), 50)]
        reference = draft_k.clone()
        by_index_pairs(*args)
        pairs = draft_k.clone()
        draft_k.copy_(reference)
        pillar_attn.fill_draft_buffers(*args)
        assert torch.equal(pairs, draft_k), "the two copies differ"
        print(f"| {name} | {B * L * n_kv * n} | {times[0]:.3f} | {times[1]:.3f} |")


if __name__ == "__main__":
    main()
