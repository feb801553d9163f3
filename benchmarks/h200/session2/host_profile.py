"""Where a decode step's wall time goes on the GPU machine: cProfile of one generate call per method (after a warm-up
call of the same size, so every CUDA graph is already recorded), plus torch.profiler's GPU-busy time.
Usage: python benchmarks/h200/session2/host_profile.py GGUF BATCH TOKENS [methods...]"""
import cProfile
import io
import pstats
import sys
import time

import torch

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.bench import DEFAULT_PROMPTS, load_workload

gguf, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
methods = sys.argv[4:] or ["plain", "pillar"]
for method in methods:
    llm = LLM(gguf=gguf, device="cuda", cuda_graphs=True, method=method, batch_policy="naive", max_batch=batch)
    _, ids = load_workload(llm, str(DEFAULT_PROMPTS), "prompt", batch, True)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    llm.generate(None, params, prompt_token_ids=ids)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(None, params, prompt_token_ids=ids)
    prof.disable()
    seconds = time.perf_counter() - start
    steps = llm.last_stats.steps
    print(f"== {method}: {batch}x{tokens}: {seconds:.2f} s, {steps} steps, {1e3 * seconds / steps:.2f} ms/step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue()[:6000])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        llm.generate(None, SamplingParams(max_new_tokens=16, ignore_eos=True), prompt_token_ids=ids)
    print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)[:5000])
