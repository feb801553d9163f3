"""Greedy equality on the GPU, diagnosed: tests/test_cuda_graphs.py's comparison (fp32, tiny random Qwen3, padded
steps) for each drafter, printing how many requests differ from plain decoding and where they first differ, with
the eager kernels or with `--compile` (on the GPU: the compiled paged kernels). (Until the sixteenth session dense
attention ran a single row unpacked, with SDPA's own GQA, and `--pack-single` packed it like the verification rows,
as it now always is: raw/equality_pack_single_call4.txt.)

Usage: PYTHONPATH=.:tests python benchmarks/h200/session5/gpu_equality.py [--compile]"""
import sys
import tempfile

import torch

from conftest import GREEDY, PROMPT_LENGTHS, make_tiny_checkpoint
from nano_sparsespec import LLM

path = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3")[0]
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def generate(**options):
    llm = LLM(str(path), device="cuda", dtype="float32", cuda_graphs=True, max_batch=5,
              compile="--compile" in sys.argv, **options)
    return [o.token_ids for o in llm.generate(None, GREEDY, prompt_token_ids=prompts)]


plain = generate(method="plain")
for method, policy, async_verify, kv_blocks in [
        ("pillar", "naive", False, None), ("pillar", "balanced", True, 12), ("pillar-lookup", "balanced", False, None),
        ("streaming", "balanced", True, None), ("ngram", "naive", True, None), ("full", "balanced", False, None)]:
    outs = generate(method=method, stride=4, min_budget=8, budget_ratio=0.1, batch_policy=policy,
                    async_verify=async_verify, kv_blocks=kv_blocks, prefill_chunk=32)
    first = [next((i for i, (a, b) in enumerate(zip(o, p)) if a != b), None) for o, p in zip(outs, plain)]
    print(f"{method:14s} {policy:9s} async={async_verify!s:5s} requests differing: "
          f"{sum(f is not None for f in first)}/{len(first)}, first difference at token {first}", flush=True)
