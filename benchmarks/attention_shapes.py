"""The fast path's attention kernels against the shape choices they run at (GPU only).

Each kernel compiled as the fast path compiles it, 30 calls (one per layer) recorded in one CUDA
graph, so that no launch gap is timed; microseconds per layer. The embedded model's heads: 3 KV
heads of 3 query heads each, head dim 64, bfloat16.

`drafts`: one layer's draft tokens against the number of draft-buffer columns N they read
(`attention.sparse_drafts`'s contract: their K/V written to the draft buffers, then attention over
their rows in place) at a busy balanced step: 910 drafts in 1,025 draft-buffer rows (a batch of
1,024 and the scratch row). Two forms: `matmul`, the reference's two batched matmuls and softmax;
`flex`, flex_drafts.py's decoding kernel. Prints each width's times, the largest difference between
the forms' outputs, and whether `cuda_graphs.fast_draft_width` keeps N.

`paged`: the paged kernel (`paged.paged_attend`: flex_attention's decoding kernel over the pool,
then the merge of the chunks) against the number of chunks each context is cut into, for a plain
step (1,024 requests, one row each) and a balanced step's verifications (114 requests of 9 rows,
with log-sum-exps), or the `--shapes` given, every context 4,000 positions or each drawn from
[256, 4,000), blocks of 64 scattered over the pool. Prints each count's time and how far its output
is from one chunk's (`paged.PAGED_CTAS`; BENCHMARKS.md, "Where a busy step's time goes"). With
`--default-merge-limits` the merge is compiled with the compiler's default limits instead of as
one kernel (`kernels.ONE_KERNEL_MERGE`).

    python benchmarks/attention_shapes.py drafts [--widths 128:480:8]
    python benchmarks/attention_shapes.py paged [--chunks 1,2,4,8] [--shapes 1024x1,114x9]
"""
import argparse
import json

import torch

from nano_sparsespec import attention, kernels
from nano_sparsespec import paged as paged_kernel
from nano_sparsespec.cuda_graphs import fast_draft_width

ROWS, DRAFTS, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 1025, 910, 3, 3, 64, 30
LONGEST, TABLE_BLOCKS = 4000, 66   # `paged`: the longest context; a block table's width


def time_layers(fn, repeats: int = 3) -> float:
    """Microseconds per call of `fn`, LAYERS calls recorded in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # warm-up (and compilation) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    drafts = kinds.add_parser("drafts", help="the drafts' attention by draft-buffer columns")
    drafts.add_argument("--widths", default="128:480:8", help="first:last:step columns")
    drafts.add_argument("--buffer-columns", type=int, default=512,
                        help="columns of each buffer row (the embedded model's with CUDA graphs)")
    paged = kinds.add_parser("paged", help="the paged kernel by chunks per context")
    paged.add_argument("--chunks", default="1,2,4,8", help="chunk counts")
    paged.add_argument("--shapes", default="1024x1,114x9",
                       help="requests x rows (rows > 1: verifications, with log-sum-exps)")
    paged.add_argument("--default-merge-limits", action="store_true",
                       help="compile the chunks' merge with the compiler's default limits")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.kind == "paged" and args.default_merge_limits:
        kernels.ONE_KERNEL_MERGE = None
    kernels.compile_kernels(paged=True)
    print(json.dumps(draft_widths(args) if args.kind == "drafts" else paged_chunks(args)))


def draft_widths(args) -> dict:
    first, last, step = (int(x) for x in args.widths.split(":"))
    forms = {"matmul": kernels.sizes_apart(torch.compile(attention.sparse_drafts, dynamic=True)),
             "flex": attention._kernels["sparse"]}
    options = dict(device="cuda", dtype=torch.bfloat16)
    T, H = DRAFTS + 1, KV_HEADS * GROUP
    q = torch.randn(T, H, HEAD_DIM, **options)                                   # [T, H, D]
    k, v = torch.randn(2, T, KV_HEADS, HEAD_DIM, **options).unbind(0)            # [T, n_kv, D]
    keys = torch.randn(ROWS, KV_HEADS, args.buffer_columns, HEAD_DIM, **options)  # [R, n_kv, C, D]
    values = torch.randn_like(keys)
    cuda = dict(device="cuda")
    q_index = torch.arange(DRAFTS, **cuda)                                       # [Bs]
    rows = torch.randperm(ROWS - 1, **cuda)[:DRAFTS]                             # [Bs]
    results = []
    for n in range(first, last + 1, step):
        valid = torch.rand(ROWS, KV_HEADS, n, **cuda) < 0.9                      # [R, n_kv, N]
        valid[..., 0] = True
        lists = (q_index, rows, rows, torch.full_like(rows, n - 1), valid)
        outs, row = {}, {"columns": n, "kept": fast_draft_width(n) == n}
        for name, form in forms.items():
            outs[name] = torch.zeros(T, H, HEAD_DIM, **options)

            def call(form=form, out=outs[name]):
                form(out, q, k, v, keys, values, *lists)
            row[f"{name}_us_per_layer"] = round(time_layers(call), 1)
        row["max_difference"] = (outs["matmul"] - outs["flex"]).abs().max().item()
        results.append(row)
        print(f"{n:4d} columns: matmul {row['matmul_us_per_layer']:6.1f}, flex "
              f"{row['flex_us_per_layer']:6.1f} us per layer, outputs apart by "
              f"{row['max_difference']:.2e}{'' if row['kept'] else '  (moved)'}", flush=True)
    return {"device": torch.cuda.get_device_name(), "rows": ROWS, "drafts": DRAFTS,
            "kv_heads": KV_HEADS, "group": GROUP, "head_dim": HEAD_DIM, "widths": results}


def paged_chunks(args) -> dict:
    counts = [int(x) for x in args.chunks.split(",")]
    cuda, block = dict(device="cuda"), 64
    blocks = TABLE_BLOCKS
    results = []
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    for batch, Q in shapes:
        with_lse = Q > 1
        for spread in (False, True):
            context = (torch.randint(256, LONGEST, (batch,)) if spread
                       else torch.full((batch,), LONGEST)).to(**cuda)                    # [B]
            pool_blocks = batch * blocks + 1
            k_layer = torch.randn(pool_blocks * block, KV_HEADS, HEAD_DIM,   # [slots, n_kv, D]
                                  dtype=torch.bfloat16, **cuda)
            v_layer = torch.randn_like(k_layer)
            table = torch.randperm(pool_blocks - 1, **cuda)[:batch * blocks].view(batch, blocks)
            q_start = context - Q                                                       # [B]
            rows = q_start[:, None] + torch.arange(Q, **cuda)                            # [B, Q]
            mask = torch.arange(blocks * block, **cuda)[None, None, :] <= rows[:, :, None]
            q_valid = torch.ones(batch, Q, dtype=torch.bool, **cuda)
            q = torch.randn(batch * Q + 1, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16,
                            **cuda)                                                     # [T, H, D]
            q_index = torch.arange(batch * Q, **cuda).view(batch, Q)
            out = torch.zeros_like(q)
            row, one_chunk = {"requests": batch, "rows": Q, "spread": spread}, None
            for splits in counts:
                block_mask = paged_kernel.paged_block_mask(table, mask, q_start, q_valid, block,
                                                           k_layer.shape[0], GROUP,
                                                           -(-blocks // splits), splits)

                def call(block_mask=block_mask):
                    paged_kernel._paged["attend"](out, q, q_index, k_layer, v_layer, block_mask,
                                                  with_lse)
                row[f"{splits}_chunks_us_per_layer"] = round(time_layers(call), 1)
                if one_chunk is None:
                    one_chunk = out.float().clone()
                else:
                    apart = (out.float() - one_chunk).abs().max().item()
                    row[f"{splits}_chunks_difference"] = apart
            results.append(row)
            print(f"{batch} requests x {Q} rows, contexts {'[256, 4000)' if spread else '4000'}: "
                  + ", ".join(f"{n} chunks {row[f'{n}_chunks_us_per_layer']:.1f}"
                              for n in counts) + " us per layer", flush=True)
    return {"device": torch.cuda.get_device_name(), "kv_heads": KV_HEADS, "group": GROUP,
            "head_dim": HEAD_DIM, "block_size": block,
            "merge": "default limits" if args.default_merge_limits else "one kernel",
            "paged_chunks": results}


if __name__ == "__main__":
    main()
