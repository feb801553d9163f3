"""Where a step's time goes on the H200, on a random model of the embedded model's shape (no files needed).

1. `kernels`: torch.profiler tables (CUDA time per kernel) of one plain, draft and verification step run eagerly with
   the `--compile` kernels (no CUDA graphs, so each kernel shows by name).
2. `host`: cProfile of the host side of the same steps with CUDA graphs (what the engine does around a replay).
3. `sdpa`: dense attention variants at Q = 1 (plain) and Q = k + 1 (verification) over gathered KV:
   torch's GQA SDPA (what the engine runs), the same with the query heads of a KV head packed into one row block
   (each KV head read once), per SDPA backend.
4. `sparse`: a draft step's gather + sparse attention for one layer: indexing variants and a compiled kernel that
   gathers inside the kernel.
5. `paged`: plain decoding's attention for one layer, reading the paged pool in place with compiled flex_attention
   (a block mask built from the block tables, the pool as one key/value sequence shared by every request) against
   the engine's gather + SDPA, for pool blocks of 16 and 64 positions. Written after this session's device time ran
   out: checked for equal results on the CPU only.
Usage: python benchmarks/h200/session4/step_anatomy.py BATCH CONTEXT PART [DEVICE]"""
import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nano_sparsespec import model as model_ops, pillar_attn
from nano_sparsespec.bench import StepProfiler, random_model
from nano_sparsespec.config import ModelConfig

batch, context, part = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cuda")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
cfg = ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                  vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5,
                  max_position_embeddings=8192, qk_norm=False)


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=20):
    """Mean milliseconds per call."""
    fn()
    synchronize()
    if device.type != "cuda":
        import time
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    synchronize()
    return start.elapsed_time(end) / reps


if part in ("kernels", "host"):
    model = random_model(cfg, device, dtype)
    pillar_attn.compile_kernels()
    model_ops.compile_elementwise()
    prof = StepProfiler(model, batch, context, 8, device, dtype, 0.05, 128, 0.6, cuda_graphs=part == "host")
    for kind in ("plain", "draft", "verify", "mixed"):
        fn = getattr(prof, kind)
        for _ in range(3):
            fn()
        if part == "kernels":
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                           if device.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as p:
                fn()
                synchronize()
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"===== {kind} {batch}x{context}: kernels by {key}", flush=True)
            print(p.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)
        else:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                fn()
            pr.disable()
            print(f"===== {kind} {batch}x{context}: host functions (5 steps, CUDA graphs)", flush=True)
            pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(22)

if part == "sdpa":
    n_kv, G, D = 3, 3, 64
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch, context, n_kv, D, device=device, dtype=dtype, generator=g)   # gathered [B, L, n_kv, D]
    v = torch.randn(batch, context, n_kv, D, device=device, dtype=dtype, generator=g)
    kv_bytes = 2 * k.numel() * k.element_size()
    for Q in (1, 9):
        q = torch.randn(batch, Q, n_kv * G, D, device=device, dtype=dtype, generator=g)
        lengths = torch.randint(context // 2, context - Q + 1, (batch,), device=device, generator=g)
        kv_pos = torch.arange(context, device=device)
        q_pos = lengths[:, None] + torch.arange(Q, device=device)
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]                                 # [B, Q, L]
        qp = q.view(batch, Q, n_kv, G, D).permute(0, 2, 3, 1, 4).reshape(batch, n_kv, G * Q, D)
        maskp = mask[:, None, None].expand(batch, 1, G, Q, context).reshape(batch, 1, G * Q, context)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)

        def gqa():
            return F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask[:, None], enable_gqa=True)

        def packed():
            return F.scaled_dot_product_attention(qp, kt, vt, attn_mask=maskp)

        ref = gqa().float()
        pk = packed().view(batch, n_kv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(batch, Q, n_kv * G, D)
        print(f"Q={Q}: packed vs gqa max abs diff {(pk.float() - ref.transpose(1, 2)).abs().max().item():.3g}")
        for name, fn in (("gqa", gqa), ("packed", packed)):
            for backend in (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
                try:
                    if backend is None:
                        ms = timed(fn)
                    else:
                        with sdpa_kernel(backend):
                            ms = timed(fn)
                    print(f"  Q={Q} {name:6s} {str(backend):32s} {ms:7.3f} ms  {kv_bytes / ms / 1e6:7.0f} GB/s (of K+V)",
                          flush=True)
                except RuntimeError as e:
                    print(f"  Q={Q} {name:6s} {str(backend):32s} not available: {str(e).splitlines()[0][:80]}")
        score_weight = torch.full((batch, Q), 1.0 / Q, device=device)
        for label, fn in (("scores eager", pillar_attn.pillar_scores),
                          ("scores compiled", torch.compile(pillar_attn.pillar_scores, dynamic=True))):
            print(f"  Q={Q} {label:22s} {timed(lambda: fn(q, k, mask, score_weight)):7.3f} ms", flush=True)

if part == "sparse":
    # A draft step's sparse attention, one layer: gather each (position, KV head)'s K and V from the pool, attend.
    n_kv, G, D, S = 3, 3, 64, 137          # S: budget 128 + the recent window
    slots = batch * (context + 16)
    g = torch.Generator(device=device).manual_seed(0)
    k_pool = torch.randn(slots * n_kv, D, device=device, dtype=dtype, generator=g)      # pool viewed [slots*n_kv, D]
    v_pool = torch.randn(slots * n_kv, D, device=device, dtype=dtype, generator=g)
    index = torch.randint(0, slots, (batch, n_kv, S), device=device, generator=g) * n_kv + \
        torch.arange(n_kv, device=device)[None, :, None]                                 # [B, n_kv, S]
    valid = torch.ones(batch, S, dtype=torch.bool, device=device)
    q = torch.randn(batch, n_kv * G, D, device=device, dtype=dtype, generator=g)
    gathered = 2 * index.numel() * D * k_pool.element_size()
    kernel = torch.compile(pillar_attn.sparse_attention, dynamic=True)
    fused_kernel = torch.compile(pillar_attn.sparse_attention_fused, dynamic=True)
    variants = {
        "gather []": lambda: (k_pool[index], v_pool[index]),
        "gather index_select": lambda: (k_pool.index_select(0, index.flatten()), v_pool.index_select(0, index.flatten())),
        "gather [] int32": lambda: (k_pool[index.int()], v_pool[index.int()]),
        "gather [] + compiled sparse_attention": lambda: kernel(q, k_pool, v_pool, index, valid),
        "compiled fused gather+attention": lambda: fused_kernel(q, k_pool, v_pool, index, valid),
    }
    ref = kernel(q, k_pool, v_pool, index, valid).float()
    print(f"fused vs gather+sparse max abs diff {(fused_kernel(q, k_pool, v_pool, index, valid).float() - ref).abs().max().item():.3g}")
    for name, fn in variants.items():
        ms = timed(fn)
        print(f"  sparse {name:40s} {ms:7.3f} ms  {gathered / ms / 1e6:6.0f} GB/s (of gathered K+V)", flush=True)
    # The dense gather of a plain step, one layer's K: whole blocks through the block table.
    block = 16
    blocks_per_request = context // block
    k_blocks = torch.randn(batch * blocks_per_request + 1, block * n_kv * D, device=device, dtype=dtype, generator=g)
    table = torch.randperm(batch * blocks_per_request, device=device, generator=g).view(batch, blocks_per_request)
    dense_bytes = 2 * table.numel() * k_blocks.shape[1] * k_blocks.element_size()    # read + written
    for name, fn in (("dense gather []", lambda: k_blocks[table]),
                     ("dense gather index_select", lambda: k_blocks.index_select(0, table.flatten()))):
        ms = timed(fn)
        print(f"  {name:47s} {ms:7.3f} ms  {dense_bytes / ms / 1e6:6.0f} GB/s (read + written)", flush=True)

if part == "paged":
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n_kv, G, D = 3, 3, 64
    g = torch.Generator(device=device).manual_seed(0)
    compiled_flex = torch.compile(flex_attention, dynamic=False)
    for block in (16, 64):
        per_request = -(-context // block)
        blocks = batch * per_request
        k_pool = torch.randn(blocks * block, n_kv, D, device=device, dtype=dtype, generator=g)   # one layer's pool
        v_pool = torch.randn(blocks * block, n_kv, D, device=device, dtype=dtype, generator=g)
        table = torch.randperm(blocks, device=device, generator=g).view(batch, per_request)   # [B, blocks/request]
        lengths = torch.randint(context // 2, context + 1, (batch,), device=device, generator=g)
        q = torch.randn(batch, n_kv * G, 1, D, device=device, dtype=dtype, generator=g)
        kv_bytes = 2 * int(lengths.sum()) * n_kv * D * k_pool.element_size()

        def gather_sdpa():      # what the engine does today: copy each request's blocks out, then SDPA
            keys = pillar_attn.gather_rows(k_pool.view(blocks, -1), table).view(batch, -1, n_kv, D)
            values = pillar_attn.gather_rows(v_pool.view(blocks, -1), table).view(batch, -1, n_kv, D)
            mask = torch.arange(keys.shape[1], device=device)[None, :] < lengths[:, None]      # [B, L]
            return F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=mask[:, None, None], enable_gqa=True)

        # Block mask: request b reads its own pool blocks; within its last block only the filled part.
        used = -(-lengths // block)                                                            # [B]
        last_block = table.gather(1, (used - 1)[:, None])[:, 0]                                # [B]
        last_fill = lengths - (used - 1) * block                                               # [B]

        def inside(b, h, q_idx, kv_idx):
            return (kv_idx // block != last_block[b]) | (kv_idx % block < last_fill[b])

        # Full blocks (every position attended: the mask is not evaluated there) and, per request, one partial block.
        full = torch.zeros(batch, 1, 1, blocks, dtype=torch.int32, device=device)              # width = pool blocks
        full[:, 0, 0, :per_request] = table.int()
        partial = torch.zeros_like(full)
        partial[:, 0, 0, 0] = last_block.int()
        block_mask = BlockMask.from_kv_blocks(torch.ones(batch, 1, 1, dtype=torch.int32, device=device), partial,
                                              (used - 1).int()[:, None, None], full, BLOCK_SIZE=block,
                                              mask_mod=inside, seq_lengths=(1, blocks * block))
        k_seq, v_seq = k_pool.permute(1, 0, 2)[None], v_pool.permute(1, 0, 2)[None]           # [1, n_kv, slots, D]

        def flex_in_place():
            return compiled_flex(q, k_seq, v_seq, block_mask=block_mask, enable_gqa=True)

        try:
            diff = (flex_in_place().float() - gather_sdpa().float()).abs().max().item()
            print(f"block {block}: flex vs gather + SDPA max abs diff {diff:.3g}", flush=True)
            variants = (("gather + SDPA", gather_sdpa), ("flex in place", flex_in_place))
        except Exception as e:   # a kernel configuration this torch / GPU does not support: say so, keep going
            print(f"block {block}: flex failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            variants = (("gather + SDPA", gather_sdpa),)
        for name, fn in variants:
            ms = timed(fn)
            print(f"  block {block:3d} {name:15s} {ms:7.3f} ms  {kv_bytes / ms / 1e6:6.0f} GB/s (of K+V in context)",
                  flush=True)
