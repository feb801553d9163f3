"""The benchmark's rows: one workload decoded by each configuration, measured side by side.

Owns the workload (reasoning prompts from a JSONL file, chat template applied, cycled to the number
of requests: every row decodes the very same token ids), the rows themselves,
        hf            transformers `generate`, batched with left padding (the peer)
        plain         our engine, method="plain" (k = 0), each step launched before the host
                      reads the previous token (`SpecConfig.runs_ahead`): our best plain path,
                      the baseline
        plain-sync    the same without the overlap
        ngram         prompt-lookup drafts, verified every step
        streaming     StreamingLLM drafts (sinks + recent window), naive lock-step, sync
        pillar-naive  PillarAttn drafts (or `--pillar-method`), naive lock-step, sync
        +balanced     ... with the staggered (balanced) batch policy
        +offload      ... with a bounded device KV pool (requests spill to the host pool and back)
        +async        ... with delayed verification: full SparseSpec
and each row's figures: tokens per second, bytes read (the byte model) and the share of the
roofline, peak memory, acceptance, and whether its tokens equal plain decoding's.
Must not change how the engine decodes: every row of ours goes through `LLM.generate`.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..config import SamplingParams, SpecConfig
from ..cuda_graphs import compile_seconds
from ..device import common_prefix
from ..llm import LLM
from .measure import (ByteModel, CompiledFrames, PeakMemory, StepClock, _left_padded,
                      hf_kv_positions, synchronize, tenths)
from .trace import HostSampler, StepWindow

DEFAULT_PROMPTS = Path(__file__).parents[1] / "prompts" / "reasoning.jsonl"

# name -> SpecConfig fields (None: transformers). "offload" is not a SpecConfig field: it means
# "bounded kv_blocks".
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
ROW_ALIASES = {"transformers": "hf", "pillar": "pillar-naive", "naive": "pillar-naive",
               "balanced": "+balanced", "offload": "+offload", "async": "+async",
               "sparsespec": "+async"}

def load_workload(llm: LLM, path: str | Path, field: str, num_requests: int, chat_template: bool,
                  max_prompt_tokens: int = 256) -> tuple[list[str], list[list[int]]]:
    """Prompts cycled to `num_requests`, and their token ids (chat template applied).

    A model directory without a tokenizer (a random test checkpoint) gets a stand-in encoding:
    each character's code point modulo the vocabulary.
    """
    from ..generate import read_prompts_file

    prompts = read_prompts_file(str(path), field)
    if not prompts:
        raise ValueError(f"no prompts in {str(path)!r}")
    prompts = [prompts[i % len(prompts)] for i in range(num_requests)]
    if llm.tokenizer is None:
        print(f"note: {llm.model_path} has no tokenizer; "
              f"prompts are encoded as code points mod vocab",
              file=sys.stderr)
        vocab = llm.model.config.vocab_size
        return prompts, [[ord(c) % vocab for c in p[:max_prompt_tokens]] or [0] for p in prompts]
    return prompts, [llm.encode(p, chat_template) for p in prompts]


def default_kv_blocks(prompt_lens: list[int], max_new_tokens: int, stride: int, block_size: int,
                      fraction: float) -> int:
    """The bounded pool of the offload rows, in blocks.

    `fraction` of what the whole batch needs at its longest (what `LLM` allocates unbounded), but
    room for every prompt plus one cycle of growth, so all requests start together and offloading
    happens while they grow (not as a queue at admission), and for the longest request alone.
    """
    worst = [-(-(p + max_new_tokens + stride + 2) // block_size) for p in prompt_lens]
    start = [-(-(p + stride + 2) // block_size) for p in prompt_lens]
    return max(math.ceil(fraction * sum(worst)), sum(start) + 1, max(worst) + 1)


# --------------------------------------------------------------------------------------------------
# The rows

def warm_up_tokens(stride: int) -> int:
    """Tokens of a row's warm-up run: two cycles of k drafts, a verification and a stall."""
    return 2 * (stride + 2)


def run_ours(llm: LLM, spec: SpecConfig, token_ids: list[list[int]], params: list[SamplingParams],
             bm: ByteModel, windows: list[StepWindow] = (),
             sampler: HostSampler | None = None) -> dict:
    """One row of ours; with `windows`, torch.profiler watches some of its timed steps
    (`StepWindow`: their synchronisations and the profiler's overhead fall inside the timed
    run); with `sampler`, the host's stack is sampled over the whole timed run."""
    llm.spec = spec
    # Warm-up: the same requests with this row's settings, a few cycles long. torch.compile
    # specialises kernels on the first step of each kind (prefill chunks beside drafts and
    # verifications, each batch-size class), seconds a server spends once at start; they must not
    # be billed to the timed run. Then the first request alone: torch.compile also specialises a
    # batch of one (the last request drafting or verifying alone), which the timed run would
    # otherwise meet in its tail. With CUDA graphs there is none: a step shape's first run is
    # its graph's recording, which is taken out of the timed run, and a warm-up's graphs and
    # compiled kernels (specialised on its own smaller KV pool) would not serve the row.
    row_start = time.perf_counter()
    with CompiledFrames() as compiled:
        if not llm.cuda_graphs:
            short = [replace(p, max_new_tokens=min(p.max_new_tokens, warm_up_tokens(spec.stride)))
                     for p in params]
            llm.generate(None, short, prompt_token_ids=token_ids)
            llm.generate(None, short[:1], prompt_token_ids=token_ids[:1])
        compiled_before = compile_seconds()
        with PeakMemory(llm.device) as mem:
            synchronize(llm.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            clock = StepClock()
            with sampler or contextlib.nullcontext():
                outputs = llm.generate(None, params, prompt_token_ids=token_ids,
                                       on_step=lambda event: observe_step(event, clock, windows))
            synchronize(llm.device)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            end = start + seconds
    stats = llm.last_stats
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    kv = sum(stats.kv_positions_per_step)
    summary = stats.summary(spec.stride)
    # Recording CUDA graphs and compiling kernels for shapes the warm-up did not meet are start-up
    # costs (a server records its graphs once, before taking requests; compiled kernels are cached
    # on disk): both are taken out of `seconds` and reported on their own, with the wall time
    # that includes them, so a run with a cold compile cache measures what a warm one does. Their
    # CPU time is not known (compilation runs in worker processes), so such a run has no CPU-time
    # figure.
    recording = stats.graph_record_seconds
    compiling = compile_seconds() - compiled_before
    one_time = recording + compiling - stats.graph_record_compile_seconds
    return {"tokens": stats.output_tokens, "seconds": seconds - one_time,
            "cpu_seconds": None if one_time else cpu_seconds,
            "wall_seconds": seconds, "graphs_recorded": stats.graphs_recorded,
            # the whole row (its warm-ups, if any) but for its decoding: what a user waits first
            "startup_seconds": time.perf_counter() - row_start - (seconds - one_time),
            "graph_record_seconds": recording,
            "engine_seconds": stats.seconds,
            # the engine loop's host time by phase (`RunStats`): where a step's wall time goes
            "host_seconds": {"schedule": stats.schedule_seconds, "launch": stats.launch_seconds,
                             "queue": stats.queue_seconds, "process": stats.process_seconds,
                             "result_wait": stats.result_wait_seconds,
                             "selections": stats.selection_seconds},
            # compiling for shapes the warm-up did not meet, inside graph recording (a new
            # bucket's first run) or not: left out of `seconds`
            "compile_seconds": compiling,
            "compile_seconds_recording": stats.graph_record_compile_seconds,
            # the whole row's compilations (warm-ups included) per compiled function
            "compiled_frames": compiled.frames,
            "steps": stats.steps, "kv_positions": kv, "bytes_read": bm.run_bytes(stats.steps, kv),
            "batch_occupancy": batch_occupancy(stats, spec.max_batch),
            "occupancy_by_tenth": occupancy_by_tenth(stats, spec.max_batch),
            "time_by_tenth": clock.time_by_tenth(end),
            "wait_by_tenth": clock.wait_by_tenth(end, stats.result_wait_seconds),
            "mean_accepted": summary.get("mean_accepted"),
            "mean_offered": summary.get("mean_offered"),
            "accepted_by_request": accepted_by_request(outputs),
            "verifications": summary.get("verifications", 0), "acceptance_by_position":
                summary.get("acceptance_by_position"),
            "offloads": stats.offloads, "restores": stats.restores, "kv_blocks": spec.kv_blocks,
            "peak_memory_bytes": mem.peak_bytes + llm.model.weight_bytes(),
            "token_ids": [o.token_ids for o in outputs],
            **({"step_windows": [w.finish() for w in windows]} if windows else {}),
            **({"host_samples": sampler.result()} if sampler else {})}


def observe_step(event, clock: StepClock, windows: list[StepWindow]) -> None:
    """A timed run's `on_step`: the clock sees every step, the profiler's windows (if any) too."""
    clock.on_step(event)
    for window in windows:
        window.on_step(event)


def batch_occupancy(stats, slots: int) -> float:
    """Mean share of the batch's slots that decode (draft or verify) in a step, over the run's
    steps.

    A lock-step run of one fixed batch falls well below 1 at its end: requests that accept less
    keep running after the others are done; --num-requests keeps the slots full until the last
    requests.
    """
    decoding = decoding_per_step(stats)
    return statistics.mean(decoding) / slots if decoding else 0.0


def accepted_by_request(outputs) -> dict | None:
    """Quantiles of the requests' own mean accepted drafts (min, p10, median, p90, max): how
    unlike the requests accept, which sets how long the slowest decode on alone at a run's end.
    None for a row without drafts."""
    means = sorted(o.stats["mean_accepted"] for o in outputs
                   if o.stats.get("mean_accepted") is not None)
    if not means:
        return None
    at = {"min": 0, "p10": 0.1, "median": 0.5, "p90": 0.9, "max": 1}
    return {name: means[round(q * (len(means) - 1))] for name, q in at.items()}


def occupancy_by_tenth(stats, slots: int) -> list[float]:
    """`batch_occupancy` over each tenth of the run's steps in turn (`tenths`): where in the run
    the idle slots lie, e.g. in a tail where the requests that accept least decode on alone."""
    decoding = decoding_per_step(stats)
    return [round(statistics.mean(decoding[first:end]) / slots, 4)
            for first, end in tenths(len(decoding))]


def decoding_per_step(stats) -> list[int]:
    """Requests that draft or verify in each step of a run."""
    return [v + d for v, d in zip(stats.verifications_per_step, stats.drafts_per_step)]


def run_hf(llm: LLM, token_ids: list[list[int]], args, bm: ByteModel) -> dict:
    """transformers `generate` on the same token ids: batched (--batch-size requests at a time,
    one batch after another), left-padded, same length and sampling settings."""
    from transformers import AutoModelForCausalLM

    device = llm.device
    with PeakMemory(device) as mem:
        hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path),
                                                  dtype=llm.dtype).to(device).eval()
        eos = None if args.ignore_eos else sorted(llm.eos_token_ids)
        # transformers falls back on the model's own generation_config for unset fields: disable
        # EOS there.
        hf.generation_config.eos_token_id = eos
        hf.config.eos_token_id = eos
        config = copy.deepcopy(hf.generation_config)
        config.update(max_new_tokens=args.max_new_tokens, pad_token_id=0,
                      do_sample=args.temperature > 0)
        if args.temperature > 0:
            config.update(temperature=args.temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            warm = copy.deepcopy(config)
            warm.update(max_new_tokens=4)
            hf.generate(**_left_padded(token_ids[:2], device), generation_config=warm)
            torch.manual_seed(args.seed)
            new, seconds, cpu_seconds, steps = [], 0.0, 0.0, 0
            # More requests than --batch-size: in turn.
            for first in range(0, len(token_ids), args.batch_size):
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
    return {"tokens": sum(lens), "seconds": seconds, "cpu_seconds": cpu_seconds, "steps": steps,
            "kv_positions": kv,
            "batch_occupancy": None, "occupancy_by_tenth": None, "time_by_tenth": None,
            "wait_by_tenth": None,
            "bytes_read": bm.run_bytes(steps, kv), "mean_accepted": None, "mean_offered": None,
            "accepted_by_request": None, "verifications": 0,
            "offloads": 0, "restores": 0, "kv_blocks": None,
            "peak_memory_bytes": mem.peak_bytes,
            "hf_weight_bytes": weights, "token_ids": outputs}


def spec_for(name: str, args, kv_blocks: int) -> SpecConfig:
    fields = dict(ROWS[name])
    offload = fields.pop("offload", False)
    if fields["method"] == "pillar":
        fields["method"] = args.pillar_method
    return SpecConfig(stride=args.stride, budget_ratio=args.budget_ratio,
                      min_budget=args.min_budget, max_batch=args.batch_size,
                      prefill_chunk=args.prefill_chunk, block_size=args.block_size,
                      plain_tail=args.plain_tail, finish_quantile=args.finish_quantile,
                      draft_ahead=not args.no_draft_ahead,
                      score_every=args.score_every, refresh_every=args.refresh_every,
                      kv_blocks=kv_blocks if offload else None, **fields)


def finish_rows(rows: list[dict], peak_gbs: float, greedy: bool) -> None:
    """Derived columns: tokens/s, speedup over plain, achieved bandwidth, roofline share,
    equality with plain.

    Also tokens per CPU-second of this process and the speedup in those terms: on a CPU shared
    with other jobs the wall clock of a row depends on what else ran meanwhile, its own CPU time
    much less (with --threads 1).
    """
    plain = next((r for r in rows if r["name"] == "plain"), None)
    for r in rows:
        r["tokens_per_second"] = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        r["tokens_per_cpu_second"] = r["tokens"] / r["cpu_seconds"] if r["cpu_seconds"] else None
        r["bandwidth_gbs"] = r["bytes_read"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
        r["roofline_share"] = r["bandwidth_gbs"] / peak_gbs if peak_gbs else None
    for r in rows:
        r["speedup_vs_plain"] = (r["tokens_per_second"] / plain["tokens_per_second"]
                                 if plain else None)
        r["speedup_vs_plain_cpu_time"] = (r["tokens_per_cpu_second"]
                                          / plain["tokens_per_cpu_second"]
                                          if r["tokens_per_cpu_second"] and plain
                                          and plain["tokens_per_cpu_second"]
                                          else None)
        if plain and greedy:
            same = sum(a == b for a, b in zip(r["token_ids"], plain["token_ids"]))
            r["identical_to_plain"] = f"{same}/{len(plain['token_ids'])}"
            r["mean_common_prefix"] = statistics.mean(
                common_prefix(a, b) for a, b in zip(r["token_ids"], plain["token_ids"]))
        else:
            r["identical_to_plain"] = r["mean_common_prefix"] = None


def parse_rows(text: str) -> list[str]:
    if text == "all":
        return list(ROWS)
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        name = ROW_ALIASES.get(name, name)
        if name not in ROWS:
            raise ValueError(f"unknown row {name!r}: expected some of {list(ROWS)} "
                             f"(comma-separated) or 'all'")
        names.append(name)
    return names



