"""torch.profiler over steady-state engine steps: which host-side ops and GPU kernels a step spends its time on.

    PYTHONPATH=. python benchmarks/h200/session6/engine_profile.py --gguf G [--batch 128] [--tokens 384]
        [--first 200] [--steps 100] [MODE ...]

MODE as in engine_split.py. Per mode: one short warm-up generation (compiles the kernels), then one generation of
`--tokens` new tokens profiled from engine step `--first` for `--steps` steps. Prints the top ops by self CPU time
(the host's share of a step) and by CUDA time, per profiled step.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.bench import DEFAULT_PROMPTS, load_workload
from nano_sparsespec.scheduler import Scheduler

from engine_split import MODES  # noqa: E402  (this folder is on sys.path when run as a script)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="*", default=["plain", "pillar-async"])
    p.add_argument("--gguf", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--first", type=int, default=200)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    schedule = Scheduler.schedule
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for mode in args.modes:
        llm = LLM(gguf=args.gguf, device=args.device, compile=True, cuda_graphs=True, max_batch=args.batch, **MODES[mode])
        texts, ids = load_workload(llm, DEFAULT_PROMPTS, "prompt", args.batch, chat_template=True)
        llm.generate(texts, SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.6),
                     prompt_token_ids=ids)
        prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (args.device == "cuda"))
        wall = []

        def scheduled(self, step):          # start and stop the profiler at given engine steps
            if step == args.first:
                synchronize()
                prof.start()
                wall.append(time.perf_counter())
            elif step == args.first + args.steps:
                synchronize()
                wall.append(time.perf_counter())
                prof.stop()
            return schedule(self, step)
        Scheduler.schedule = scheduled
        llm.generate(texts, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0.6),
                     prompt_token_ids=ids)
        Scheduler.schedule = schedule
        averages = prof.key_averages()
        total_cpu = sum(e.self_cpu_time_total for e in averages) / args.steps / 1e3
        total_cuda = sum(e.self_device_time_total for e in averages) / args.steps / 1e3
        print(f"\n## {mode}: per step, wall {(wall[1] - wall[0]) / args.steps * 1e3:.2f} ms (profiled), self CPU "
              f"{total_cpu:.2f} ms (all ops), self CUDA {total_cuda:.2f} ms")
        for key, title in (("self_cpu_time_total", "self CPU"), ("self_device_time_total", "self CUDA")):
            print(f"\ntop by {title} (ms per step, calls per step):")
            for e in sorted(averages, key=lambda e: -getattr(e, key))[:args.rows]:
                print(f"  {getattr(e, key) / args.steps / 1e3:8.3f}  {e.count / args.steps:7.1f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
