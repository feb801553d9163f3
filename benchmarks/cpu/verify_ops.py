"""Where one verification step's CPU time goes, by torch operator: the embedded model, BATCH requests of CONTEXT cached
positions each verifying k = 8 drafts (bench.StepProfiler's verification step: the step, then the selection of the
next critical positions), one thread, under torch.profiler.

    PYTHONPATH=. python benchmarks/cpu/verify_ops.py [BATCH] [CONTEXT]      # default 8 1024

Fifteenth session: benchmarks/cpu/session15_verify_ops.txt.
"""
import sys

import torch

from nano_sparsespec.async_loop import LLM
from nano_sparsespec.bench import StepProfiler
from nano_sparsespec.config import SpecConfig


def main():
    batch, context = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (8, 1024)))
    torch.set_num_threads(1)
    llm = LLM(None, device="cpu", dtype=torch.float32)
    spec = SpecConfig()
    steps = StepProfiler(llm.model, batch, context, spec.stride, torch.device("cpu"), torch.float32,
                         spec.budget_ratio, spec.min_budget, 0.0)
    for _ in range(2):
        steps.verify()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = steps.verify()
    print(f"verification step, {batch} x {context}, k = {spec.stride}: {seconds * 1e3:.1f} ms (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
