"""One layer's dense attention on the H200, the engine's paged kernel against gather + SDPA, and the PillarAttn
score pass variants tried this session; a random pool of the embedded model's shape (3 KV heads x 64, 9 query heads).

1. Plain decoding (Q = 1) and verification (Q = k + 1 = 9): gather each request's blocks + SDPA (the engine before
   session 5, and still its CPU path) against `pillar_attn.paged_attention` (compiled flex_attention reading the
   pool in place through `paged_block_mask`), for pool blocks of BLOCK positions.
2. Verification's score pass (Q = 9): the engine's compiled `pillar_scores` on gathered keys, and four variants
   written here, none adopted: library kernels (bmm, softmax, bmm); each row's logsumexp taken from the attention
   (flex_attention returns it) so one reduction is left, as matmuls on gathered keys or as elementwise products
   reading the pool through the block table; and the "transposed" flex_attention (keys as queries, the query rows as
   keys, bias log(w) - lse: the score is exp of that attention's logsumexp).

Usage: python benchmarks/h200/session5/paged.py BATCH CONTEXT [BLOCK [DEVICE]]
Raw output (benchmarks/h200/session5/raw/, callN = the session's Nth device call): paged_128_2048_b16_call2.txt,
paged_128_2048_b{16,64}_call3.txt, paged_128_2048_b64_scores_call4.txt, from this script's earlier revisions (same
kernels, the functions then in the package; the transposed variant was measured only inside a whole verification
step: step_modes_call5_*.txt)."""
import sys

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from nano_sparsespec import pillar_attn

batch, context = int(sys.argv[1]), int(sys.argv[2])
bs = int(sys.argv[3]) if len(sys.argv) > 3 else 64
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cuda")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
n_kv, G, D = 3, 3, 64
H = n_kv * G


def timed(fn, reps=20):
    """Mean milliseconds per call (CUDA events; wall clock on a CPU)."""
    fn()
    if device.type != "cuda":
        import time
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def paged_with_lse(q, k_layer, v_layer, block_mask):
    """paged_attention that also returns each row's logsumexp [B, H, Q] (not on the CPU: compiled, it cannot)."""
    B, Q = q.shape[:2]
    out, aux = flex_attention(pillar_attn._pack_groups(q, n_kv), k_layer.permute(1, 0, 2)[None],
                              v_layer.permute(1, 0, 2)[None], block_mask=block_mask, return_aux=AuxRequest(lse=True))
    return out, aux.lse.view(B, H, Q)


def scores_softmax_bmm(q, keys, mask, weight):
    """Library kernels: bf16 logits by bmm, float32 softmax, the weighted sum over rows as one more bmm."""
    B, Q = q.shape[:2]
    L = keys.shape[1]
    packed = pillar_attn._pack_groups(q, n_kv)                                         # [B, n_kv, G*Q, D]
    logits = torch.stack([torch.bmm(packed[:, h], keys[:, :, h].transpose(1, 2)) for h in range(n_kv)], dim=1)
    logits = (logits.float() * D ** -0.5).view(B, n_kv, G, Q, L).masked_fill_(~mask[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1).view(B * n_kv, G * Q, L)
    w = (weight.float() / G)[:, None, None, :].expand(B, n_kv, G, Q).reshape(B * n_kv, 1, G * Q)
    return torch.bmm(w, probs).view(B, n_kv, L)


def scores_given_lse(q, keys, mask, weight, lse):
    """pillar_scores with each row's logsumexp given: one reduction over the logits instead of two."""
    B, Q = q.shape[:2]
    logits = pillar_attn.attention_logits(q, keys, mask)                               # [B, n_kv, G, Q, L]
    w = weight.float()[:, None, None, :, None] / G
    return (torch.exp(logits - lse.view(B, n_kv, G, Q, 1)) * w).sum(dim=(2, 3))


def scores_paged_elementwise(q, k_blocks, table, mask, weight, lse):
    """The same, keys read from the pool through the block table inside the reduction (elementwise products)."""
    B, Q = q.shape[:2]
    keys = pillar_attn.gather_rows(k_blocks, table).view(B, 1, 1, -1, n_kv, D).permute(0, 4, 1, 2, 3, 5).float()
    queries = q.view(B, Q, n_kv, G, 1, D).permute(0, 2, 3, 1, 4, 5).float()           # [B, n_kv, G, Q, 1, D]
    probs = torch.exp((queries * keys).sum(-1) * D ** -0.5 - lse.view(B, n_kv, G, Q, 1))
    probs = probs.masked_fill(~mask[:, None, None], 0.0)
    return (probs * weight.float()[:, None, None, :, None] / G).sum(dim=(2, 3))


def scores_transposed_flex(q, keys, q_start, q_valid, weight, lse):
    """flex_attention with the context's keys as queries and the G x Q rows as keys; bias_r = log(w_r / G) - lse_r,
    so its logsumexp at position l is log sum_r w_r / G exp(logit_rl - lse_r): the score is its exp."""
    B, Q = q.shape[:2]
    rows = pillar_attn._pack_groups(q, n_kv)                                           # [B, n_kv, G*Q, D]
    w = (weight.float() / G)[:, None, None, :].expand(B, n_kv, G, Q).reshape(B, n_kv, G * Q)
    bias = torch.where(w > 0, w.log() - lse.view(B, n_kv, G * Q), float("-inf"))

    def add_bias(score, b, h, position, r):
        row = r % Q
        seen = (position <= q_start[b] + row) & (q_valid[b, row] | (position == 0))
        return torch.where(seen, score + bias[b, h, r], float("-inf"))
    _, aux = flex_attention(keys.transpose(1, 2), rows, rows, score_mod=add_bias, return_aux=AuxRequest(lse=True))
    return aux.lse.exp()


g = torch.Generator(device=device).manual_seed(0)
nb = context // bs
pool_blocks = batch * nb + 1
k_pool = torch.randn(pool_blocks * bs, n_kv, D, device=device, dtype=dtype, generator=g)       # one layer's pool
v_pool = torch.randn(pool_blocks * bs, n_kv, D, device=device, dtype=dtype, generator=g)
k_blocks, v_blocks = k_pool.view(pool_blocks, -1), v_pool.view(pool_blocks, -1)
table = torch.randperm(batch * nb, device=device, generator=g).view(batch, nb)                 # [B, nb]
paged = torch.compile(pillar_attn.paged_attention, dynamic=False)   # dynamic shapes: not flex's decoding kernel
variants = {"engine (compiled pillar_scores)": torch.compile(pillar_attn.pillar_scores, dynamic=True),
            "bmm + softmax + bmm, eager": scores_softmax_bmm,
            "bmm + softmax + bmm, compiled": torch.compile(scores_softmax_bmm, dynamic=True)}
with_lse = {"lse given, matmuls": torch.compile(scores_given_lse, dynamic=True),
            "lse given, pool read in place": torch.compile(scores_paged_elementwise, dynamic=True),
            "lse given, transposed flex": torch.compile(scores_transposed_flex, dynamic=False)}

for Q in (1, 9):
    lengths = torch.randint(context // 2, context + 1, (batch,), device=device, generator=g)   # with the Q new ones
    q_start = lengths - Q
    qi = torch.arange(Q, device=device)
    q_valid = torch.ones(batch, Q, dtype=torch.bool, device=device)
    mask = torch.arange(nb * bs, device=device)[None, None] <= (q_start[:, None] + qi)[:, :, None]   # [B, Q, L]
    weight = torch.full((batch, Q), 1.0 / Q, device=device)
    q = torch.randn(batch, Q, H, D, device=device, dtype=dtype, generator=g)
    kv_bytes = 2 * int(lengths.sum()) * n_kv * D * k_pool.element_size()

    def gather_sdpa():
        keys = pillar_attn.gather_rows(k_blocks, table).view(batch, -1, n_kv, D)
        values = pillar_attn.gather_rows(v_blocks, table).view(batch, -1, n_kv, D)
        return pillar_attn.dense_attention(q, keys, values, mask)[0]

    def block_mask():
        return pillar_attn.paged_block_mask(table, mask, q_start, q_valid, bs, k_pool.shape[0], G)

    bm = block_mask()
    ref = gather_sdpa()
    print(f"Q={Q}, blocks of {bs}: {kv_bytes / 1e6:.0f} MB of K+V in context", flush=True)
    print(f"  block mask build {timed(block_mask):7.3f} ms (once per step, not per layer; eager launches)", flush=True)
    ms = timed(gather_sdpa)
    print(f"  gather + SDPA    {ms:7.3f} ms  {kv_bytes / ms / 1e6:6.0f} GB/s", flush=True)
    try:
        diff = (paged(q, k_pool, v_pool, bm).float() - ref.float()).abs().max().item()
    except Exception as e:   # a configuration this torch / GPU does not support: say so, keep going
        print(f"  paged: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        continue
    ms = timed(lambda: paged(q, k_pool, v_pool, bm))
    print(f"  paged            {ms:7.3f} ms  {kv_bytes / ms / 1e6:6.0f} GB/s  (max abs diff {diff:.3g})", flush=True)
    if Q == 1:
        continue
    keys = pillar_attn.gather_rows(k_blocks, table).view(batch, -1, n_kv, D)
    print(f"  gather K alone   {timed(lambda: pillar_attn.gather_rows(k_blocks, table)):7.3f} ms", flush=True)
    ref_scores = pillar_attn.pillar_scores(q, keys, mask, weight)
    for name, fn in variants.items():
        diff = (fn(q, keys, mask, weight) - ref_scores).abs().max().item()
        print(f"  scores, {name:32s} {timed(lambda: fn(q, keys, mask, weight)):7.3f} ms  (max abs diff {diff:.3g})",
              flush=True)
    if device.type != "cuda":
        print("  (the logsumexp variants: GPU only, compiled flex_attention on a CPU cannot return it)")
        continue
    lse = torch.compile(paged_with_lse, dynamic=False)(q, k_pool, v_pool, bm)[1]
    args = {"lse given, matmuls": (q, keys, mask, weight, lse),
            "lse given, pool read in place": (q, k_blocks, table, mask, weight, lse),
            "lse given, transposed flex": (q, keys, q_start, q_valid, weight, lse)}
    for name, fn in with_lse.items():
        diff = (fn(*args[name]) - ref_scores).abs().max().item()
        print(f"  scores, {name:32s} {timed(lambda: fn(*args[name])):7.3f} ms  (max abs diff {diff:.3g})", flush=True)
