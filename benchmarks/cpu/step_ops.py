"""Where one decode step's CPU time goes, by torch operator: the embedded model, BATCH requests of CONTEXT cached
positions each, one thread, under torch.profiler. KIND is bench.StepProfiler's step: plain (one token each), draft
(one token each, attending to the critical positions and the recent window) or verify (k = 8 drafts each, then the
selection of the next critical positions).

    PYTHONPATH=. python benchmarks/cpu/step_ops.py [KIND] [BATCH] [CONTEXT] [DTYPE]   # default verify 8 1024 float32

Fifteenth session (as verify_ops.py): benchmarks/cpu/session15_verify_ops.txt; sixteenth: session16_step_ops.txt.
"""
import sys

import torch

from nano_sparsespec.async_loop import LLM
from nano_sparsespec.bench import StepProfiler
from nano_sparsespec.config import SpecConfig


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "verify"
    batch, context = (int(a) for a in (sys.argv[2:4] if len(sys.argv) > 3 else (8, 1024)))
    dtype = getattr(torch, sys.argv[4] if len(sys.argv) > 4 else "float32")
    if kind not in ("plain", "draft", "verify"):
        raise SystemExit(f"unknown step kind {kind!r}: expected plain, draft or verify")
    torch.set_num_threads(1)
    llm = LLM(None, device="cpu", dtype=dtype)
    spec = SpecConfig()
    steps = StepProfiler(llm.model, batch, context, spec.stride, torch.device("cpu"), dtype,
                         spec.budget_ratio, spec.min_budget, 0.0)
    step = getattr(steps, kind)
    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = step()
    print(f"{kind} step, {batch} x {context}, {dtype}, k = {spec.stride}: {seconds * 1e3:.1f} ms (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
