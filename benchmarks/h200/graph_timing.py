"""Timing GPU work the way the engine runs it with --cuda-graphs: recorded once as a CUDA graph, then replayed."""
import time

import torch


def replay_ms(run, reps: int = 20) -> float:
    """Milliseconds per replay of a CUDA graph recorded over `run()` (warmed up on a side stream first, as a
    recording wants: the first calls compile and allocate)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def timed_ms(run, device: str) -> float:
    """Milliseconds of `run()`: a replayed CUDA graph on a GPU; on a CPU (a smoke test) one call by the clock after a
    warm-up call."""
    if device == "cuda":
        return replay_ms(run)
    run()
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3
