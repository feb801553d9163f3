"""Device time per call of the fast path's compiled K/V write and elementwise pieces, compiled as the fast path
compiles them (static sizes but the token rows: `kernels.compile_store`, `kernels.compile_elementwise`) against the
same functions compiled for dynamic sizes (`torch.compile(fn, dynamic=True)`), at the embedded model's shapes:
544 and 1,056 token rows (plain steps of batch 512 and 1,024) and 1,952 (a balanced step of batch 1,024 with 1,026
window writes). Each timed as a CUDA graph of 30 calls, replayed 10 times. GPU only.

    python benchmarks/static_sizes.py OUT.json
"""
import json
import sys

import torch

from nano_sparsespec import attention, kernels, model

H, N_KV, D, HIDDEN, INTER = 9, 3, 64, 576, 1536       # SmolLM2-135M
POOL_SLOTS, BUFFER_ROWS, BUFFER_COLUMNS = 1024 * 4096, 1025, 272


def device_us(fn, args) -> float:
    """Microseconds of device time a call of fn(*args), from a CUDA graph of 30 calls."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(30):
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / 300, 2)


def main() -> None:
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.zeros(2, POOL_SLOTS, N_KV, D, dtype=dtype, device=dev)
    buffers = torch.zeros(2, BUFFER_ROWS, N_KV, BUFFER_COLUMNS, D, dtype=dtype, device=dev)
    results = {}
    for rows, window_writes in ((544, 0), (1056, 0), (1952, 1026)):
        qkv = torch.randn(rows, H + 2 * N_KV, D, dtype=dtype, device=dev, generator=g)
        slots = torch.randperm(POOL_SLOTS, device=dev, generator=g)[:rows]
        window = () if not window_writes else (
            *buffers, torch.randperm(rows, device=dev, generator=g)[:window_writes],
            torch.randint(0, BUFFER_ROWS, (window_writes,), device=dev, generator=g),
            torch.randint(0, BUFFER_COLUMNS, (window_writes,), device=dev, generator=g))
        store_args = (*pool, slots, qkv[:, H:H + N_KV], qkv[:, H + N_KV:], *window)
        x, delta = torch.randn(2, rows, HIDDEN, dtype=dtype, device=dev, generator=g).unbind(0)
        weight = torch.randn(HIDDEN, dtype=dtype, device=dev, generator=g)
        cos, sin = torch.randn(2, rows, 1, D // 2, device=dev, generator=g).unbind(0)
        cases = {"store_kv": (attention.store_kv, store_args, kernels.compile_store),
                 "add_rms_norm": (model.add_rms_norm, (x, delta, weight, 1e-5), None),
                 "silu_mul": (model.silu_mul, (torch.randn(rows, 2 * INTER, dtype=dtype, device=dev,
                                                           generator=g),), None),
                 "apply_rope": (model.apply_rope, (qkv[:, :H + N_KV], cos, sin), None)}
        for name, (fn, args, fast_path) in cases.items():
            torch._dynamo.reset()
            dynamic = device_us(torch.compile(fn, dynamic=True), args)
            torch._dynamo.reset()
            if fast_path is None:
                kernels.compile_elementwise()
                fast = device_us(model._ops[name], args)
                model.use_eager_elementwise()
            else:
                fast = device_us(fast_path(), args)
            results[f"{name}, {rows} rows, {window_writes} window writes"] = {"dynamic": dynamic, "fast path": fast}
            print(f"{name:13s} {rows:5d} rows: dynamic sizes {dynamic:6.2f} us, fast path {fast:6.2f} us", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_call": results},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
