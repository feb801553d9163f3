"""Host vs GPU time of one plain, draft and verification step with CUDA graphs (batch x context on the embedded
model): the step through the engine's runner, then its recorded graph replayed alone (GPU time of the forward).
Usage: python benchmarks/h200/session2/step_split.py GGUF BATCH CONTEXT [compile]"""
import statistics
import sys
import time

import torch

from nano_sparsespec import LLM
from nano_sparsespec.bench import StepProfiler

gguf, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
compiled = sys.argv[4:] == ["compile"]
llm = LLM(gguf=gguf, device="cuda", compile=compiled)
print(f"compile={compiled}")
for temperature in (0.6,):
    prof = StepProfiler(llm.model, batch, context, 8, llm.device, llm.dtype, 0.05, 128, temperature,
                        cuda_graphs=True)
    for kind, fn, runner in (("plain", prof.plain, prof.plain_runner), ("draft", prof.draft, prof.runner),
                             ("verify", prof.verify, prof.runner)):
        fn()
        whole = statistics.median(fn() for _ in range(7))
        step = next(s for s in runner.graphs.steps.values()
                    if (s.bucket.sparse_batch > 0) == (kind == "draft") and
                    (s.bucket.dense_queries > 1) == (kind == "verify"))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step.graph.replay()
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t) / 20
        print(f"T={temperature} {kind:6s} {batch}x{context}: step {whole * 1e3:7.2f} ms, graph replay alone "
              f"{gpu * 1e3:7.2f} ms, rest (host, sampling, verify) {1e3 * (whole - gpu):7.2f} ms  bucket {step.bucket}",
              flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
        prof.plain(); prof.draft(); prof.verify()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)[:4000])
    del prof
