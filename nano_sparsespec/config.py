"""Configuration objects: what the model is, how to speculate, how to sample.

Owns `ModelConfig` (the decoder's shape, read from a Hugging Face `config.json`: Qwen3, or a
Llama-family model, which lacks q/k RMSNorm; unsupported features fail here), `SpecConfig` (the
speculation settings) and `SamplingParams` (per-request sampling).

Must not import torch models: this file is plain data and validation, readable before anything else.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# architecture name -> has q/k RMSNorm
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and features, as read from a Hugging Face `config.json`."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool                       # Qwen3: RMSNorm on every query/key head; Llama: none
    rope_scaling: dict | None = None    # None, or {"rope_type": "linear"|"llama3", ...}
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "Qwen3ForCausalLM"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """A `ModelConfig` from a parsed `config.json`; ValueError names an unsupported feature."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:       # no architectures listed: fall back on model_type
            model_type = cfg.get("model_type")
            arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                             f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
        for key in ("num_experts", "num_local_experts", "moe_intermediate_size"):
            if cfg.get(key):
                raise ValueError(f"unsupported config feature {key}={cfg[key]!r}: "
                                 "mixture-of-experts models are not supported")
        sliding = (cfg.get("use_sliding_window")
                   or "sliding_attention" in (cfg.get("layer_types") or ()))
        if sliding or (arch == "LlamaForCausalLM" and cfg.get("sliding_window")):
            raise ValueError("unsupported config feature "
                             f"sliding_window={cfg.get('sliding_window')!r}: "
                             "only full attention is supported")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"unsupported config feature {key}=True: "
                                 "bias terms are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: "
                             "only 'silu' (SwiGLU) is supported")
        rope_theta, rope_scaling = cfg.get("rope_theta"), None
        # transformers 4 writes rope_scaling (its type may be spelled "type"), 5 rope_parameters
        for key in ("rope_scaling", "rope_parameters"):
            params = cfg.get(key) or {}
            legacy_type = params.get("type", "default") if key == "rope_scaling" else "default"
            rope_type = params.get("rope_type", legacy_type)
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}: "
                                 f"expected one of {SUPPORTED_ROPE_TYPES}")
            rope_theta = params.get("rope_theta", rope_theta)
            if rope_type != "default":
                rope_scaling = {**params, "rope_type": rope_type}
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=SUPPORTED_ARCHITECTURES[arch],
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """A `ModelConfig` from `model_dir/config.json`; FileNotFoundError if it is missing."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass
class SamplingParams:
    """How one request samples. temperature == 0 means greedy (top_k / top_p are then ignored)."""
    temperature: float = 0.0
    top_k: int = 0            # 0: no top-k filter
    top_p: float = 1.0        # 1.0: no nucleus filter
    max_new_tokens: int = 256
    seed: int | None = None   # None: drawn at random when the request is added
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        self.stop = tuple([self.stop] if isinstance(self.stop, str) else self.stop)
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if (not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature))
                or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p cuts its distribution (ignored when greedy)."""
        return self.top_k > 0 or self.top_p < 1.0


DRAFT_METHODS = ("plain", "pillar", "streaming", "ngram", "full", "pillar-lookup")
PILLAR_METHODS = ("pillar", "pillar-lookup")   # choose critical positions from verification scores
SPARSE_METHODS = PILLAR_METHODS + ("streaming",)   # drafts over a budget of positions
BATCH_POLICIES = ("naive", "balanced")
DEFAULT_LOOKUP_MATCHES = 8     # pillar-lookup's matches per draft step


@dataclass
class SpecConfig:
    """Speculation settings shared by every request of an engine.

    method         plain (no drafting: k = 0), pillar (PillarAttn critical tokens), streaming
                   (sink + recent window), ngram (prompt lookup), full (dense drafts: the oracle),
                   pillar-lookup (PillarAttn refreshed at every draft step by token lookup)
    stride         k, draft steps per verification
    budget_ratio, min_budget
                   critical positions per (layer, KV head): B = max(min_budget, ceil(ratio * ctx))
    sink_tokens    sink positions kept by the streaming policy
    lookup_matches pillar-lookup: earlier positions of the draft's input token (and the one after
                   each) that replace the lowest-ranked critical ones; None: `num_lookups`
    keep_accepted  pillar, pillar-lookup: the positions a verification just accepted join the next
                   selection first, in place of its lowest-ranked positions (the budget stays), as
                   the official SparseSpec code keeps them; it raises acceptance a little
    score_every    pillar, pillar-lookup: PillarAttn scores layers 0, n, 2n, ... only; a layer
                   between takes the selection of the scored layer before it. The scores cost a
                   verification about as much as its attention; fewer scored layers cut that and
                   lower acceptance a little (BENCHMARKS.md)
    refresh_every  pillar, pillar-lookup: verifications re-select from their scores in one period
                   of the phase clock in n (step // period % n == 0); in the others they compute no
                   scores and keep their requests' selections, with keep_accepted's positions
                   first. Default 1 (every verification, the paper's)
    ngram_max, ngram_min   n-gram lengths tried by ngram drafting, longest first
    batch_policy   naive (all requests verify on the same step) or balanced (staggered)
    async_verify   delayed verification: a request that verifies at step t sits out step t+1
    draft_ahead    with async_verify, pillar, pillar-lookup and streaming: instead of sitting out
                   step t+1, the request drafts there, at the position and on the token that its
                   verification leaves on the device, with its previous selection (no stall)
    plain_tail     once the decoding requests fall below this share of the most that decoded
                   together, with none waiting or offloaded, the requests left decode plainly
                   (0: never): a step over few requests costs about its floor, which drafts
                   cannot undercut (Scheduler)
    finish_quantile
                   before that, with none waiting or offloaded, a request that would end after
                   the one at this quantile of the batch's projected ends even were it to decode
                   plainly from now on decodes plainly (1: never), so that the least accepting
                   requests do not drain alone (plain_tail.py)
    kv_blocks      device KV pool size in blocks (None: sized for the whole batch; small: offload)
    block_size     tokens per KV block
    prefill_chunk  prompt tokens per step over all prefilling requests (chunked prefill)
    max_batch      requests running at once
    """
    method: str = "plain"
    stride: int = 8
    budget_ratio: float = 0.05
    min_budget: int = 128
    sink_tokens: int = 4
    lookup_matches: int | None = None
    keep_accepted: bool = True
    score_every: int = 1
    refresh_every: int = 1
    ngram_max: int = 4
    ngram_min: int = 2
    batch_policy: str = "balanced"
    async_verify: bool = False
    draft_ahead: bool = True
    plain_tail: float = 0.125
    finish_quantile: float = 0.95
    kv_blocks: int | None = None
    block_size: int = 64
    prefill_chunk: int = 2048
    max_batch: int = 64

    def __post_init__(self):
        self.validate()

    def dense_batch(self) -> int:
        """Requests that attend densely in a step of a full batch: all of them when they decode
        plainly or verify together (naive), one in stride + 1 under balanced batching."""
        if self.method == "plain" or self.batch_policy == "naive":
            return self.max_batch
        return -(-self.max_batch // (self.stride + 1))

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"unknown method {self.method!r}: expected one of {DRAFT_METHODS}")
        if not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"stride (k) must be an integer >= 1, got {self.stride!r}")
        if not (isinstance(self.budget_ratio, (int, float)) and 0.0 < self.budget_ratio <= 1.0):
            raise ValueError(f"budget_ratio must be in (0, 1], got {self.budget_ratio!r}")
        if not isinstance(self.min_budget, int) or self.min_budget < 1:
            raise ValueError(f"min_budget must be an integer >= 1, got {self.min_budget!r}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if self.lookup_matches is not None and (not isinstance(self.lookup_matches, int)
                                                or self.lookup_matches < 1):
            raise ValueError(f"lookup_matches must be an integer >= 1 (or None for the default), "
                             f"got {self.lookup_matches!r}")
        if self.method == "pillar-lookup" and self.min_budget < 2 * self.num_lookups:
            raise ValueError(f"min_budget={self.min_budget} is too small for "
                             f"lookup_matches={self.num_lookups}: "
                             f"pillar-lookup needs min_budget >= 2 * lookup_matches")
        if not isinstance(self.score_every, int) or self.score_every < 1:
            raise ValueError(f"score_every must be an integer >= 1, got {self.score_every!r}")
        if not isinstance(self.refresh_every, int) or self.refresh_every < 1:
            raise ValueError(f"refresh_every must be an integer >= 1, got {self.refresh_every!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min!r}, "
                             f"{self.ngram_max!r}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"unknown batch_policy {self.batch_policy!r}: "
                             f"expected one of {BATCH_POLICIES}")
        if not (isinstance(self.plain_tail, (int, float)) and 0.0 <= self.plain_tail < 1.0):
            raise ValueError(f"plain_tail must be in [0, 1), got {self.plain_tail!r}")
        if not (isinstance(self.finish_quantile, (int, float))
                and 0.0 <= self.finish_quantile <= 1.0):
            raise ValueError(f"finish_quantile must be in [0, 1], got {self.finish_quantile!r}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {self.kv_blocks!r}")
        if self.block_size < 1 or self.prefill_chunk < 1 or self.max_batch < 1:
            raise ValueError(f"block_size, prefill_chunk and max_batch must be >= 1, got "
                             f"{self.block_size!r}, {self.prefill_chunk!r}, {self.max_batch!r}")

    @property
    def drafts_per_cycle(self) -> int:
        """Model draft steps per verification: 0 for plain, and for ngram (it drafts on the CPU)."""
        return 0 if self.method in ("plain", "ngram") else self.stride

    @property
    def runs_ahead(self) -> bool:
        """Async plain decoding: step t+1 decodes on step t's sampled token, still on the device."""
        return self.async_verify and self.method == "plain"

    @property
    def drafts_ahead(self) -> bool:
        """Async sparse drafting: step t+1 drafts on step t's verification result, still on the
        device (its position and input token too: `draft_ahead`)."""
        return (self.async_verify and self.draft_ahead
                and self.method in SPARSE_METHODS)

    @property
    def num_lookups(self) -> int:
        """pillar-lookup's matches per draft step: `lookup_matches`, else 8 capped at B // 2."""
        if self.lookup_matches is not None:
            return self.lookup_matches
        return max(1, min(DEFAULT_LOOKUP_MATCHES, self.min_budget // 2))

    def budget(self, context_len: int) -> int:
        """Critical positions per (layer, KV head) for a verified context of `context_len`."""
        return max(self.min_budget, math.ceil(self.budget_ratio * context_len))
