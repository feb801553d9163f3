"""Step split of the kernel choices behind `--compile`, on a random model of the embedded model's shape (no files
needed), with CUDA graphs: one plain, one draft and one verification step, each timed whole (host + GPU) and as its
recorded graph replayed alone (GPU time of the forward); and the mixed step of balanced batching (one request in
k + 1 verifying, the others drafting; added after this session's H200 run).

Modes: `eager` (the readable path); `compile` (fused elementwise ops, compiled sparse kernel and PillarAttn score
pass, gather + SDPA for dense attention: `--compile` before session 5); `compile-no-scores` (the same with the score
pass left eager); `paged` (session 5, what `--compile` does on a GPU: `compile` with dense attention reading the pool
in place). A mode may end in `@BLOCK`, the pool's block size (default: SpecConfig's).
Usage: python benchmarks/h200/session3/step_modes.py BATCH CONTEXT [DEVICE [MODE,MODE...]]"""
import statistics
import sys
import time

import torch

from nano_sparsespec import model as model_ops, pillar_attn
from nano_sparsespec.bench import StepProfiler, random_model
from nano_sparsespec.config import ModelConfig, SpecConfig

batch, context = int(sys.argv[1]), int(sys.argv[2])
device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
cfg = ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                  vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5,
                  max_position_embeddings=8192, qk_norm=False)
model = random_model(cfg, device, dtype)


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["eager", "compile", "compile-no-scores"]
for mode in modes:
    kernels, _, block = mode.partition("@")
    pillar_attn.use_eager_kernels()
    model_ops.use_eager_elementwise()
    if kernels != "eager":
        pillar_attn.compile_kernels(paged=kernels == "paged")
        model_ops.compile_elementwise()
    if kernels == "compile-no-scores":
        pillar_attn._kernels["scores"] = pillar_attn.pillar_scores
    prof = StepProfiler(model, batch, context, 8, device, dtype, 0.05, 128, 0.6, cuda_graphs=True,
                        block_size=int(block or SpecConfig.block_size))
    for kind, fn, runner in (("plain", prof.plain, prof.plain_runner), ("draft", prof.draft, prof.runner),
                             ("verify", prof.verify, prof.runner), ("mixed", prof.mixed, prof.runner)):
        fn()
        whole = statistics.median(fn() for _ in range(7))
        line = f"{mode:17s} {kind:6s} {batch}x{context}: step {whole * 1e3:7.2f} ms"
        if device.type == "cuda":
            step = next(s for s in runner.graphs.steps.values()             # the bucket this kind of step used
                        if (s.bucket.sparse_batch > 0) == (kind in ("draft", "mixed")) and
                        (s.bucket.dense_queries > 1) == (kind in ("verify", "mixed")))
            synchronize()
            t = time.perf_counter()
            for _ in range(20):
                step.graph.replay()
            synchronize()
            line += f", graph replay alone {(time.perf_counter() - t) / 20 * 1e3:7.2f} ms"
        print(line, flush=True)
    del prof
