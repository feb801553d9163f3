"""torch.profiler over steady-state engine steps: which host-side ops and GPU kernels a step spends its time on.

    PYTHONPATH=. python benchmarks/h200/session6/engine_profile.py --gguf G [--batch 128] [--tokens 384]
        [--first 200] [--steps 100] [MODE ...]

MODE as in engine_split.py. Per mode: one short warm-up generation (compiles the kernels), then one generation of
`--tokens` new tokens profiled from engine step `--first` for `--steps` steps. Prints the top ops by self CPU time
(the host's share of a step) and by CUDA time, per profiled step.

`--by-source` (session 12): the steps run eagerly (no CUDA graphs: a replayed graph's kernels have no Python stack),
and the top ops by CUDA time (CPU time on a CPU) are grouped by the package functions they ran from (each named by
its file and the line of its `def`), so a kernel of the profile above can be traced to the code it comes from.
On the H200 (session 13, call 2) it found no package frame for any op or kernel: the attribution works on the CPU
only so far. With `--by-source`, steps run eagerly and without the paged kernel (it needs the CUDA-graph path).
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
    p.add_argument("--by-source", action="store_true", help="eager steps, ops grouped by the functions they ran from")
    args = p.parse_args()
    schedule = Scheduler.schedule
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for mode in args.modes:
        llm = LLM(gguf=args.gguf, device=args.device, compile=True, cuda_graphs=not args.by_source,
                  max_batch=args.batch, **MODES[mode])
        texts, ids = load_workload(llm, DEFAULT_PROMPTS, "prompt", args.batch, chat_template=True)
        llm.generate(texts, SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.6),
                     prompt_token_ids=ids)
        prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (args.device == "cuda"),
                       with_stack=args.by_source)
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
        if args.by_source:
            print_by_source(prof, args.steps, args.rows, "self_device_time_total" if args.device == "cuda"
                            else "self_cpu_time_total")


def print_by_source(prof, steps: int, rows: int, key: str) -> None:
    """The top ops by `key` (their self time: kernels count on the op that launched them), grouped by op and the
    package functions it ran from (innermost first, from the profiler's Python call events)."""
    totals = {}
    for e in prof.events():
        if ".py(" in e.name or e.name.startswith("<built-in"):               # a Python call, not an op
            continue
        lines, parent = [], e.cpu_parent
        while parent is not None:
            if "nano_sparsespec/" in parent.name:
                lines.append(parent.name.split("nano_sparsespec/")[-1])
            parent = parent.cpu_parent
        entry = totals.setdefault((e.name, " < ".join(lines[:4])), [0.0, 0])
        entry[0] += getattr(e, key)
        entry[1] += 1
    print(f"\ntop by {key} with the package functions they ran from (ms per step, calls per step):")
    for (name, where), (time_us, count) in sorted(totals.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"  {time_us / steps / 1e3:8.3f}  {count / steps:7.1f}  {name[:70]}")
        print(f"            {where or '(no package frame)'}")

if __name__ == "__main__":
    main()
