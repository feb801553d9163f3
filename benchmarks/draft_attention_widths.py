"""The drafts' attention against the number of draft-buffer columns it reads (GPU only).

Times one layer's draft tokens (`attention.sparse_drafts`'s contract: their K/V written to the
draft buffers, then attention over their rows in place) at a busy balanced step of the embedded
model: 910 drafts in 1,025 draft-buffer rows (a batch of 1,024 and the scratch row), 3 KV heads of
3 query heads each, head dim 64, bfloat16; 30 calls (one per layer) recorded in one CUDA graph,
so that no launch gap is timed. Two forms, each compiled as the fast path compiles it: `matmul`,
the reference's two batched matmuls and softmax; `flex`, flex_drafts.py's decoding kernel. Prints
microseconds per layer for each width N, the largest difference between the forms' outputs, and
whether `cuda_graphs.fast_draft_width` keeps N (BENCHMARKS.md, "Where a busy step's time goes").

    python benchmarks/draft_attention_widths.py [--widths 128:480:8]
"""
import argparse
import json

import torch

from nano_sparsespec import attention, kernels, verifier
from nano_sparsespec.cuda_graphs import fast_draft_width

ROWS, DRAFTS, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 1025, 910, 3, 3, 64, 30


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
    parser.add_argument("--widths", default="128:480:8", help="first:last:step columns")
    parser.add_argument("--buffer-columns", type=int, default=512,
                        help="columns of each buffer row (the embedded model's with CUDA graphs)")
    args = parser.parse_args()
    first, last, step = (int(x) for x in args.widths.split(":"))
    torch.manual_seed(0)
    kernels.compile_kernels(paged=True)
    forms = {"matmul": verifier.sizes_apart(torch.compile(attention.sparse_drafts, dynamic=True)),
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
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": ROWS, "drafts": DRAFTS,
                      "kv_heads": KV_HEADS, "group": GROUP, "head_dim": HEAD_DIM,
                      "widths": results}))


if __name__ == "__main__":
    main()
