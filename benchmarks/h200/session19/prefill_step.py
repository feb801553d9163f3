"""What a step that carries a prefill chunk spends its time on, with CUDA graphs on. Written at a025f0b, where such a
step ran eagerly with the whole batch's decoding work in it (BENCHMARKS.md, H200 nineteenth session); since fc10892
it is the replay of the decoding work plus a padded static step of the prefill chunks (`ModelRunner.launch`).

    PYTHONPATH=. python benchmarks/h200/session19/prefill_step.py --gguf G [--batch 128] [--requests 160]
        [--tokens 512] [--profile 2] [MODE ...]

MODE as in session6/engine_split.py. Per mode: a short warm-up generation, then one generation of `--requests`
requests through `--batch` rows (a finished request's row takes the next waiting one, so later admissions carry a
prefill chunk beside the running batch). Each step with a prefill chunk is timed alone (synchronised before and
after): the host's time in `ModelRunner.launch`, and the device time between two CUDA events around it; the first
`--profile` of them after the first admission wave run under torch.profiler, whose top ops by self CPU and by self
CUDA time are printed (ms per profiled step, calls per step).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.bench import DEFAULT_PROMPTS, load_workload
from nano_sparsespec.runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session6"))
from engine_split import MODES  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="*", default=["plain-ahead", "pillar-async"])
    p.add_argument("--gguf", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--profile", type=int, default=2)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    cuda = args.device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    launch = ModelRunner.launch
    for mode in args.modes:
        llm = LLM(gguf=args.gguf, device=args.device, compile=True, cuda_graphs=True, max_batch=args.batch,
                  **MODES[mode])
        params = [SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0.6, seed=i)
                  for i in range(args.requests)]
        texts, ids = load_workload(llm, DEFAULT_PROMPTS, "prompt", args.requests, chat_template=True)
        llm.generate(texts[:args.batch], [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.6)]
                     * args.batch, prompt_token_ids=ids[:args.batch])
        timings, profiled = [], []

        def timed(self, works):
            if not any(w.kind == "prefill" for w in works):
                return launch(self, works)
            running = sum(w.kind != "prefill" for w in works)
            prof = None
            if running and len(profiled) < args.profile:
                prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
                prof.start()
            synchronize()
            start = time.perf_counter()
            if cuda:
                began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                began.record()
            result = launch(self, works)
            host = time.perf_counter() - start
            if cuda:
                ended.record()
            synchronize()
            device = began.elapsed_time(ended) if cuda else float("nan")
            if prof is not None:
                prof.stop()
                profiled.append(prof)
            chunks = [w.num_tokens for w in works if w.kind == "prefill"]
            timings.append((host * 1e3, device, running, chunks))
            return result
        ModelRunner.launch = timed
        try:
            llm.generate(texts, params, prompt_token_ids=ids)
        finally:
            ModelRunner.launch = launch
        later = [t for t in timings if t[2]]
        print(f"\n## {mode}: {len(timings)} steps with a prefill chunk, {len(later)} of them beside running requests")
        for host, device, running, chunks in later[:8]:
            print(f"  host {host:8.2f} ms  device {device:8.2f} ms  running {running:4d}  chunks {chunks}")
        if later:
            print(f"  median host {statistics.median(t[0] for t in later):.2f} ms, median device "
                  f"{statistics.median(t[1] for t in later):.2f} ms")
        for prof in profiled:
            averages = prof.key_averages()
            for key, title in (("self_cpu_time_total", "self CPU"), ("self_device_time_total", "self CUDA")):
                total = sum(getattr(e, key) for e in averages) / 1e3
                print(f"\n  top by {title} ({total:.2f} ms in all; ms, calls):")
                for e in sorted(averages, key=lambda e: -getattr(e, key))[:args.rows]:
                    print(f"    {getattr(e, key) / 1e3:8.3f}  {e.count:6d}  {e.key[:90]}")


if __name__ == "__main__":
    main()
