"""Model shapes for the step profile: random weights of a named shape (no files), and the memory a
profile of a shape needs.

Owns `MODEL_SHAPES` (the fields that differ from a Qwen3 model's), `shape_config`, `random_model`,
`parameter_count`, `profile_memory_needed` and `memory_available`; profile.py times their steps.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import CausalLM, RotaryEmbedding

# Model shapes for the step profile (random weights; no files): the fields that differ from a
# Qwen3 model's (QWEN3_FIELDS). smollm2-135m is the embedded model's shape.
MODEL_SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, rope_theta=1e5, qk_norm=False, eos_token_ids=(2,),
                         architecture="LlamaForCausalLM"),
}
QWEN3_FIELDS = dict(rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True, eos_token_ids=(151645,),
                    architecture="Qwen3ForCausalLM")


def shape_config(name: str, max_len: int) -> ModelConfig:
    return ModelConfig(**{**QWEN3_FIELDS, **MODEL_SHAPES[name]}, max_position_embeddings=max_len)


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> CausalLM:
    """A CausalLM of this shape with random weights, allocated directly in `dtype` on `device`."""
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.rope = RotaryEmbedding(cfg).to(device)
    return model.eval().requires_grad_(False)


def parameter_count(cfg: ModelConfig) -> int:
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + 2 * h
             + (2 * cfg.head_dim if cfg.qk_norm else 0))
    return cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer + h


def profile_memory_needed(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: int,
                          stride: int, weights_loaded: bool) -> int:
    """Rough bytes a profile needs: weights, the KV pool, and the largest transient tensors
    (logits, one layer's gathered K/V and attention probabilities, the verification scores)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    length = context + stride + 1
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * batch * (length + 16)
    rows = batch * (stride + 1)
    logits = 3 * rows * cfg.vocab_size * 4
    gathered = 4 * batch * length * cfg.num_kv_heads * cfg.head_dim * elem
    probs = 3 * batch * cfg.num_heads * (stride + 1) * length * 4
    scores = cfg.num_layers * batch * cfg.num_kv_heads * length * 4
    weights = 0 if weights_loaded else parameter_count(cfg) * elem
    return weights + kv + logits + gathered + probs + scores


def memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
