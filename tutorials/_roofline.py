"""The bytes-and-FLOPs model of a decode step (tutorial 00 explains it; tutorials 02, 04 and 07 reuse it), and the
step costs an H200 measures, which the model does not predict.

A step takes at least max(bytes moved / memory bandwidth, FLOPs / peak FLOP/s): the roofline. One step reads every
weight once (whatever the number of tokens in it) plus the KV cache positions its queries attend to.
"""
from __future__ import annotations

import torch

from nano_sparsespec.config import ModelConfig
from nano_sparsespec.model import CausalLM

GB = 1e9

# Qwen3-8B (its config.json); bf16 weights and KV: 2 bytes per number.
QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                       tie_word_embeddings=False, qk_norm=True)
# name: (memory bandwidth bytes/s, dense bf16 peak FLOP/s, memory bytes)
GPUS = {"H100 SXM": (3.35e12, 989e12, 80e9),
        "H200 (spec)": (4.8e12, 989e12, 141e9),
        "H200 (measured)": (4.3e12, 989e12, 141e9)}
H200 = GPUS["H200 (measured)"]


def weight_bytes_per_step(cfg: ModelConfig, bytes_per_number: int) -> int:
    """Bytes of weights one decode step reads: every matrix once, but of the input embedding only the rows of the
    step's tokens (negligible), unless the head is tied to it. Counted on the package's own model, built on the
    `meta` device (shapes only, no memory)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return bytes_per_number * sum(p.numel() for name, p in model.named_parameters()
                                  if cfg.tie_word_embeddings or not name.startswith("embed_tokens"))


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_number: int) -> int:
    """K and V, every layer, every KV head: what attending to one more position of context reads."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_number


def flops_per_step(cfg: ModelConfig, tokens: int, attended: int, weight_numbers: int) -> float:
    """2 x multiply-adds: every weight once per token, plus q.k and p.v for every (query token, position) pair
    (`attended` pairs in all), in every layer and query head."""
    return 2 * weight_numbers * tokens + 2 * 2 * attended * cfg.num_heads * cfg.head_dim * cfg.num_layers


def roofline_ms(bytes_moved: float, flops: float, bandwidth: float, peak: float) -> float:
    """A step cannot be faster than its memory traffic or its arithmetic allows: max of the two, in ms."""
    return 1e3 * max(bytes_moved / bandwidth, flops / peak)


def step_ms(tokens: int, kv_read: int, attended: int, cfg: ModelConfig = QWEN3_8B, gpu=H200) -> float:
    """Roofline ms of one bf16 step: `tokens` through the weights, `kv_read` KV positions read (each once),
    `attended` (query, position) pairs."""
    w_bytes = weight_bytes_per_step(cfg, 2)
    return roofline_ms(w_bytes + kv_read * kv_bytes_per_token(cfg, 2),
                       flops_per_step(cfg, tokens, attended, w_bytes // 2), gpu[0], gpu[1])


# ----------------------------------------------------------------------------------------------------------------------
# What an H200 measures (BENCHMARKS.md, "Step profile and ceiling" and "Step profile at 4,096 positions": bf16, CUDA
# graphs, compiled kernels, ms per step over B requests x C cached positions). The roofline above costs a verification
# like a plain step; measured, it is 3.8-6.4x one.

# SmolLM2-135M-Instruct, the embedded model (bf16 on the H200).
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                           max_position_embeddings=8192, tie_word_embeddings=True, qk_norm=False)
# name: (model, batch, context, ms per step of (plain, draft, verification, mixed, plain over 64 positions = the
# floor), accepted drafts of 8 it is read at)
MEASURED_H200 = {
    "SmolLM2-135M, 128 x 2,048": (SMOLLM2_135M, 128, 2048, (3.97, 3.06, 25.46, 7.57, 2.70), 5.27),
    "SmolLM2-135M, 512 x 4,096": (SMOLLM2_135M, 512, 4096, (15.85, 4.54, 60.20, 12.41, 3.15), 6.0),
    "SmolLM2-135M, 1,024 x 4,096": (SMOLLM2_135M, 1024, 4096, (30.36, 5.88, 118.54, 21.14, 4.52), 6.0),
    "Qwen3-8B shape, 64 x 8,000": (QWEN3_8B, 64, 8000, (27.53, 9.80, 106.01, 24.77, 8.40), 6.0),
}
PAYS_TODAY = ("On the H200 SparseSpec does not pay today (a verification costs 3.8-6.4x a plain step, and full "
              "SparseSpec runs at 0.23x plain decoding at 128 x 2,048); on one CPU thread at long contexts it does "
              "(pillar-lookup with balanced batching: 1.41x plain at 8 x 4,096).")
MODEL_LEAVES_OUT = ("What the roofline leaves out: the verification's PillarAttn score pass (every layer's keys "
                    "gathered and read again, then a top-k), the fixed cost of a step that bytes do not count (kernel launches, "
                    "small GEMMs, LM head, sampling: 2.7 of a 4.0 ms plain step of the small model), gathers of "
                    "scattered positions, plain decoding reaching only 28-52% of the bandwidth, and slots left idle "
                    "by stalls and the batch's tail.")


def modelled_verify_ratio(cfg: ModelConfig, batch: int, context: int, k: int = 8) -> float:
    """The roofline's verification (k + 1 rows per request) over its plain step, at one shape."""
    return (step_ms(batch * (k + 1), batch * context, batch * (k + 1) * context, cfg)
            / step_ms(batch, batch * context, batch * context, cfg))


def measured_rows(k: int = 8) -> list[list]:
    """Per measured H200 shape: the roofline's verification / plain step beside the measured one, a draft over a plain
    step, and what a cycle gives at the measured costs: lock-step (a + 1) t_plain / (k t_draft + t_verify), balanced
    (a + 1) / (k + 1) t_plain / t_mixed, and the ceiling (a + 1) / (k + 1) t_plain / t_floor (no self-speculative
    step costs less than the floor)."""
    rows = []
    for shape, (cfg, batch, context, (plain, draft, verify, mixed, floor), a) in MEASURED_H200.items():
        rows.append([shape, plain, f"{modelled_verify_ratio(cfg, batch, context, k):.1f}x", f"{verify / plain:.1f}x",
                     f"{draft / plain:.2f}x", a, f"{(a + 1) * plain / (k * draft + verify):.2f}x",
                     f"{(a + 1) / (k + 1) * plain / mixed:.2f}x", f"{(a + 1) / (k + 1) * plain / floor:.2f}x"])
    return rows


MEASURED_HEADERS = ["H200 shape (BENCHMARKS.md)", "plain ms", "verify/plain: model", "measured", "draft/plain",
                    "accepted", "lock-step", "balanced", "ceiling"]
