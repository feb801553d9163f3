"""Step split on a random model of the embedded model's shape (no files needed), CUDA graphs with three kernel
choices: all eager; fused elementwise ops + compiled sparse kernel with eager SDPA dense attention; everything compiled.
Usage: python benchmarks/h200/session2/fused_split.py BATCH CONTEXT"""
import statistics
import sys
import time

import torch

from nano_sparsespec import model as model_ops, pillar_attn
from nano_sparsespec.bench import StepProfiler, random_model
from nano_sparsespec.config import ModelConfig

batch, context = int(sys.argv[1]), int(sys.argv[2])
cfg = ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                  vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5,
                  max_position_embeddings=8192, qk_norm=False)
model = random_model(cfg, torch.device("cuda"), torch.bfloat16)
for mode in ("eager", "fused+sparse", "all"):
    if mode != "eager":
        model_ops.compile_elementwise()
        pillar_attn._kernels["sparse"] = torch.compile(pillar_attn.sparse_attention, dynamic=True)
    if mode == "all":
        pillar_attn._kernels["dense"] = torch.compile(pillar_attn.dense_attention, dynamic=True)
    prof = StepProfiler(model, batch, context, 8, torch.device("cuda"), torch.bfloat16, 0.05, 128, 0.6,
                        cuda_graphs=True)
    for kind, fn in (("plain", prof.plain), ("draft", prof.draft), ("verify", prof.verify)):
        fn()
        print(f"{mode:13s} {kind:6s} {batch}x{context}: {1e3 * statistics.median(fn() for _ in range(5)):7.2f} ms",
              flush=True)
    del prof
