"""The bytes-and-FLOPs model of a decode step (tutorial 00 explains it; tutorials 02 and 04 reuse it).

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
