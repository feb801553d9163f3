"""The drafts' attention against the number of draft-buffer columns it reads (GPU only).

Times `attention.sparse_attention`, compiled as the fast path compiles it, at a full balanced step
of the embedded model: 1,025 draft-buffer rows (a batch of 1,024 and the scratch row), 3 KV heads
of 3 query heads each, head dim 64, bfloat16; 30 calls (one per layer) recorded in one CUDA graph,
so that no launch gap is timed. Prints microseconds per layer for each width N and whether
`cuda_graphs.fast_draft_width` keeps it (BENCHMARKS.md, "Where a busy step's time goes").

    python benchmarks/draft_attention_widths.py [--widths 128:480:8]
"""
import argparse
import json

import torch

from nano_sparsespec.attention import sparse_attention
from nano_sparsespec.cuda_graphs import fast_draft_width

ROWS, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 1025, 3, 3, 64, 30


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
    attend = torch.compile(sparse_attention, dynamic=True)
    options = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(ROWS, KV_HEADS * GROUP, HEAD_DIM, **options)                # [R, H, D]
    keys = torch.randn(ROWS, KV_HEADS, args.buffer_columns, HEAD_DIM, **options)  # [R, n_kv, C, D]
    values = torch.randn_like(keys)
    results = []
    for n in range(first, last + 1, step):
        valid = torch.rand(ROWS, KV_HEADS, n, device="cuda") < 0.9              # [R, n_kv, N]
        us = time_layers(lambda: attend(q, keys[:, :, :n], values[:, :, :n], valid))
        results.append({"columns": n, "us_per_layer": round(us, 1),
                        "kept": fast_draft_width(n) == n})
        print(f"{n:4d} columns: {us:6.1f} us per layer{'' if results[-1]['kept'] else '  (moved)'}",
              flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": ROWS, "kv_heads": KV_HEADS,
                      "group": GROUP, "head_dim": HEAD_DIM, "widths": results}))


if __name__ == "__main__":
    main()
