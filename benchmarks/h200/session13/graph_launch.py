"""What one CUDA graph replay costs the host, against the number of kernels the graph holds.

    python benchmarks/h200/session13/graph_launch.py

The profile of a plain engine step (BENCHMARKS.md, H200 eleventh session) spent ~1.0 ms of host time in
`cudaGraphLaunch` for one replay of a graph of ~450 kernels, ~2.2 ms for SparseSpec's ~1,000. This times `replay()`
on the host for graphs of N tiny kernels (one in-place add each): with the GPU idle, and queued behind a long kernel
(is the launch's cost per kernel, or does the host wait for room in the GPU's queue?), and the GPU time per replay.
"""
import time

import torch


def main():
    x = torch.zeros(1024, device="cuda")
    for n in (100, 300, 600, 1200):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        idle, queued = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            idle.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        for _ in range(5):
            torch.cuda._sleep(50_000_000)            # ~25 ms of GPU time ahead of the replays
            for _ in range(3):
                start = time.perf_counter()
                graph.replay()
                queued.append(time.perf_counter() - start)
            torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        med = lambda v: sorted(v)[len(v) // 2] * 1e6
        print(f"{n:5d} kernels: host replay() idle {med(idle):8.1f} us ({med(idle) / n:.2f} us/kernel), "
              f"queued behind a long kernel {med(queued):8.1f} us; GPU {begin.elapsed_time(end) / 10 * 1e3:8.1f} us "
              f"per replay ({begin.elapsed_time(end) / 10 * 1e3 / n:.2f} us/kernel)")


if __name__ == "__main__":
    main()
