"""The Qwen3 decoder and its loader.

Owns the network — embedding, RMSNorm, RoPE, GQA attention with optional q/k RMSNorm, SwiGLU MLP,
tied or untied LM head — and loading it from a Hugging Face directory of safetensors.

Must not know about drafting, verification or scheduling: every attention is one call,
`attention.attend(layer_idx, q, k, v, ctx)`, where `ctx` (built by the engine) decides what each
token attends to; `ctx=None` is plain causal attention (`CausalLM.full_logits`, the cache-free
reference). A step's tokens arrive flattened: input_ids [T], positions [T], of any requests.
"""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from . import attention
from .batch_invariant import Linear, linear, mean_of_squares
from .config import ModelConfig


# ---- the elementwise pieces of a layer -----------------------------------------------------------
# The eager versions are the reference; the fast path swaps in fused ones
# (`kernels.compile_elementwise`).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             mean_sq=mean_of_squares) -> torch.Tensor:
    """x: [..., dim] -> RMS-normalised in float32, cast back, scaled by weight (HF Qwen3 order);
    mean_sq: the row reduction, [..., dim] -> [..., 1] (the fast path passes its own)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(mean_sq(xf) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 mean_sq=mean_of_squares) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)), [..., dim] each: the residual add fused into the norm."""
    x = x + delta
    return x, rms_norm(x, weight, eps, mean_sq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim/2] -> x rotated (rotate-half)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * inter] (gate | up) -> silu(gate) * up: [T, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_ops = {fn.__name__: fn for fn in (rms_norm, add_rms_norm, apply_rope, silu_mul)}
_eager_ops = dict(_ops)


def use_eager_elementwise() -> None:
    """Restore the eager reference versions of the elementwise pieces."""
    _ops.update(_eager_ops)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale [dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops["rms_norm"](x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the sum normalised); x as it is when there is no delta yet (first layer)."""
        if delta is None:
            return x, self(x)
        return _ops["add_rms_norm"](x, delta, self.weight, self.eps)


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [head_dim/2] for RoPE, with the config's rope_scaling (none, linear, llama3)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.float()
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).float()
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, interpolated, inv_freq).float()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (HF Llama/Qwen3 rotate-half)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, rope_inverse_frequencies(cfg))      # [max_pos, head_dim/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim/2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Attention(nn.Module):
    """GQA self-attention: fused qkv projection (rows q | k | v), optional q/k RMSNorm, RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], ctx) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `ctx` decides what each token attends to (None: causal)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.n_heads + 2 * self.n_kv, self.head_dim)  # q | k | v
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=1)  # [T, heads, head_dim]
        if self.q_norm is not None:
            q, k = (_ops["apply_rope"](self.q_norm(q), *rope),
                    _ops["apply_rope"](self.k_norm(k), *rope))
        else:   # q and k lie side by side: rotated in one pass (one kernel, not two, compiled)
            q, k = (_ops["apply_rope"](qkv[:, :self.n_heads + self.n_kv], *rope)
                    .split([self.n_heads, self.n_kv], 1))
        out = attention.attend(self.layer_idx, q, k, v, ctx)           # [T, n_heads, head_dim]
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU MLP: [T, hidden] -> [T, hidden]; gate and up projections fused (rows: gate | up)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_ops["silu_mul"](self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention then MLP, each with a residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, delta, rope, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) -> this layer's (x, delta), all [T, hidden]; the residual is x + delta."""
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rope, ctx))
        return x, self.mlp(h)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `logits` maps the rows you need."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx=None) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rope(positions)                              # cos, sin: [T, 1, head_dim/2]
        if ctx is not None:
            attention.prepare(ctx, self.config.num_heads // self.config.num_kv_heads)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, rope, ctx)
        return self.norm.add_forward(x, delta)[1]

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32):
        """hidden [N, hidden] -> logits [N, vocab] in `dtype` (float32: what sampling wants), or
        with None in the weights' dtype (the engine's sampler casts them as it reads them)."""
        if self.lm_head is None:                                 # tied to the embedding
            out = linear(hidden, self.embed_tokens.weight)
        else:
            out = self.lm_head(hidden)
        return out if dtype is None else out.to(dtype)

    @torch.inference_mode()
    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference path: logits [T, vocab] of one sequence, causal attention, no KV cache."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.logits(self.forward(input_ids, positions, ctx=None))

    def weight_bytes(self) -> int:
        """Bytes of parameters one forward step reads (rotary tables are buffers: not counted)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


# ---- loading from a Hugging Face directory -------------------------------------------------------

def _hf_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (along dim 0) to build it."""
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"],
               "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
    qk_norm = ["self_attn.q_norm", "self_attn.k_norm"] if cfg.qk_norm else []
    layer = ["self_attn.qkv_proj", "self_attn.o_proj", *qk_norm, "mlp.gate_up_proj",
             "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    for i in range(cfg.num_layers):
        for name in layer:  # HF uses our names, but for the fused ones
            sources[f"layers.{i}.{name}.weight"] = [f"model.layers.{i}.{hf}.weight"
                                                    for hf in fused.get(name, [name])]
    return sources


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
    where = {}
    for file in files:
        with _open_safetensors(file) as f:
            where.update({name: file for name in f.keys()})
    return where


def _open_safetensors(file: Path):
    """An open safetensors handle; FileNotFoundError or ValueError naming a missing or bad file."""
    if not file.is_file():
        raise FileNotFoundError(f"safetensors file {str(file)!r} is missing (listed in the index)")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read safetensors file {str(file)!r} "
                         f"(truncated or corrupt?): {e}") from e


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build a CausalLM from a HF directory (config.json + safetensors) and load its weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    where = _weight_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state, handles = {}, {}
    with ExitStack() as stack:   # closes the opened files
        for name, hf_names in _hf_sources(cfg).items():
            missing = [n for n in hf_names if n not in where]
            if missing:
                raise ValueError(f"weight {missing[0]!r} not found in {str(model_dir)!r}")
            parts = []
            for hf_name in hf_names:
                file = where[hf_name]
                if file not in handles:
                    handles[file] = stack.enter_context(_open_safetensors(file))
                try:
                    parts.append(handles[file].get_tensor(hf_name).to(dtype))
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise ValueError(f"cannot read tensor {hf_name!r} from {str(file)!r} "
                                     f"(truncated or corrupt?): {e}") from e
            state[name] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
    model = model.to_empty(device=device).to(dtype)
    expected = model.state_dict()
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"weight {name!r} in {str(model_dir)!r} has shape "
                             f"{tuple(tensor.shape)}, config says {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True)
    model.rope = RotaryEmbedding(cfg).to(device)             # buffers are not in the checkpoint
    return model.eval().requires_grad_(False)
