"""Where a draft step's GPU time goes at a Qwen3 shape (random weights), against a plain step of the same batch.

    PYTHONPATH=. python benchmarks/h200/session20/draft_profile.py [--model qwen3-8b] [--batch 64] [--context 8000]
        [--kinds plain,draft]        # any of the profiler's step kinds: plain, draft, verify, mixed (session 23)

Builds the bench's `StepProfiler` on the fast path (CUDA graphs, compiled kernels, as `LLM(compile=True,
cuda_graphs=True)` sets them), replays each step kind a few times, then profiles `--steps` replays of each (a plain
and a draft step unless `--kinds` says otherwise) with torch.profiler and prints the kernels by GPU time per step.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from nano_sparsespec import pillar_attn, verifier
from nano_sparsespec.bench import StepProfiler, qwen3_shape, random_model
from nano_sparsespec.model import compile_elementwise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--kinds", default="plain,draft")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    pillar_attn.compile_kernels(paged=True)
    compile_elementwise()
    verifier.compile_sampling()
    model = random_model(qwen3_shape(args.model, args.context + 10), device, dtype)
    prof = StepProfiler(model, args.batch, args.context, 8, device, dtype, 0.05, 128, 0.0, cuda_graphs=True)
    for kind in args.kinds.split(","):
        step = getattr(prof, kind)
        for _ in range(3):
            step()
        times = sorted(step() for _ in range(5))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tracer:
            for _ in range(args.steps):
                step()
        events = tracer.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / args.steps / 1e3
        print(f"\n## {args.model} {args.batch}x{args.context} {kind}: median {times[2] * 1e3:.2f} ms per step "
              f"(host-timed), {gpu:.2f} ms of kernels per step (budget {prof.budget})")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
            ms, calls = e.self_device_time_total / args.steps / 1e3, e.count / args.steps
            print(f"  {ms:8.3f} ms {calls:6.1f}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
