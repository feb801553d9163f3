"""The engine loop, synchronous or with delayed verification, and what it lets callers observe.

Owns
  * `Engine`: the loop schedule(t) -> launch(t) -> process(t-1 or t) and the host bookkeeping of a
    step's results: committing accepted tokens, rolling back rejected KV, refreshing each
    request's critical positions (re-selected from the scores, or kept when its verification
    computed none: `SpecConfig.refresh_every`), stop checks (EOS, stop strings, max_new_tokens,
    context end) and statistics. Sync: step t's results are processed before step t+1 is
    scheduled. Delayed verification (`SpecConfig.async_verify`): step t is launched *before* the
    host processes step t-1, so on CUDA the host bookkeeping of t-1 overlaps the device work of t
    (the one synchronisation is `StepResult.fetch`). A request whose verification is still in
    flight sits out one step (the stall); plain decoding, and the plain tail of a drafting run
    (scheduler.py), instead run ahead on the token in flight (`SpecConfig.runs_ahead`), and sparse
    drafters draft ahead of it (`SpecConfig.drafts_ahead`). On the CPU the same schedule runs with
    no overlap.
  * the observer callbacks (`Observers`), through which tools and tutorials watch the engine:
    each launched step (`StepEvent`), each commit of tokens, each refreshed selection; and the
    run's `RunStats` (run_stats.py), filled step by step.

Must not re-implement sampling (verifier.py) or attention (attention.py, pillar_attn.py).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import ngram, pillar_attn
from .config import PILLAR_METHODS, SpecConfig
from .device import to_device
from .kv_cache import KVCache
from .model import CausalLM
from .run_stats import RunStats, kv_positions_read
from .runner import ModelRunner
from .scheduler import Scheduler, Sequence, Status, Work
from .step_result import StepResult


@dataclass
class StepEvent:
    """One launched step, as `Observers.on_step` sees it."""
    step: int                      # the global step number (the phase clock's t)
    works: list[Work]              # what each scheduled request does this step
    running: list[Sequence]        # the scheduler's running requests right after scheduling
    offloaded: list[Sequence]      # ... and its offloaded ones
    started: float                 # time.perf_counter() when scheduling began
    launch_seconds: float          # host seconds the launch took (device work is not awaited)
    kv_positions: int              # KV positions its attention reads (`kv_positions_read`)
    graphs_recorded: int = 0       # CUDA graphs recorded so far: the steps' and the refresh's
    graph_record_seconds: float = 0.0  # ... and the seconds that took
    graph_record_compile_seconds: float = 0.0  # ... of which torch.compile compiled
    result_wait_seconds: float = 0.0   # host seconds spent waiting for steps' results so far


# (request, new tokens, accepted drafts)
CommitCallback = Callable[[Sequence, list[int], int], None]
SelectionCallback = Callable[[Sequence, "torch.Tensor | None", torch.Tensor], None]


@dataclass
class Observers:
    """Callbacks through which tools and tutorials watch a run; each may be None.

    on_step(event)                    after each step is launched (`StepEvent`)
    on_commit(seq, tokens, accepted)  tokens a request commits: `accepted` of them were drafts
    on_selection(seq, scores, chosen) a request's critical positions are refreshed: scores
                                      [L, n_kv, context] (PillarAttn; None for streaming, and
                                      for a selection kept without scores), chosen
                                      [L, n_kv, n] the positions its next drafts attend to
    """
    on_step: Callable[[StepEvent], None] | None = None
    on_commit: CommitCallback | None = None
    on_selection: SelectionCallback | None = None


class Engine:
    """Runs a batch of requests to completion on one model and one KV pool."""

    def __init__(self, model: CausalLM, spec: SpecConfig, cache: KVCache, eos_token_ids: set[int],
                 decode_tail: Callable[[list[int]], str] | None = None, cuda_graphs: bool = False,
                 runner_class: type[ModelRunner] = ModelRunner):
        self.model, self.spec, self.cache = model, spec, cache
        self.eos, self.decode_tail = eos_token_ids, decode_tail
        self.max_len = model.config.max_position_embeddings
        self.scheduler = Scheduler(spec, cache, self.max_len)
        self.runner = runner_class(model, cache, spec, cuda_graphs)
        self.stats = RunStats()

    def add(self, seq: Sequence) -> None:
        if not seq.prompt_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if seq.num_prompt >= self.max_len:
            raise ValueError(f"prompt of {seq.num_prompt} tokens does not fit the context of "
                             f"{self.max_len} tokens")
        vocab = self.model.config.vocab_size
        bad = [t for t in seq.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.scheduler.add(seq)

    def run(self, observers: Observers | None = None) -> RunStats:
        self.observers = observers or Observers()
        # objects alive before the run (model, torch, compiler) stay out of the collector's full
        # passes, which would walk them every few hundred steps; a caller's frozen ones stay frozen
        thaw = gc.get_freeze_count() == 0
        gc.freeze()
        try:
            return self._loop()
        finally:
            if thaw:
                gc.unfreeze()

    def _loop(self) -> RunStats:
        start = time.perf_counter()
        step, in_flight = 0, None
        while self.scheduler.has_work() or in_flight is not None:
            scheduled = time.perf_counter()
            works = self.scheduler.schedule(step) if self.scheduler.has_work() else []
            planned = time.perf_counter()
            self.stats.schedule_seconds += planned - scheduled
            # a decoding request with no work and no result in flight waits for its verify slot
            waiting = any(s.status == Status.RUNNING for s in self.scheduler.running)
            if not works and in_flight is None and not waiting:
                raise RuntimeError("scheduler made no progress: no request could be scheduled")
            launched = (self.runner.launch(works, self.scheduler.batch_growth()) if works
                        else None)
            self.stats.launch_seconds += time.perf_counter() - planned
            if launched is not None:
                self._record_step(step, works, scheduled)
            # delayed verification: step t-1 is processed while step t runs
            if in_flight is not None:
                self._process(in_flight)
            in_flight = launched
            if not self.spec.async_verify and in_flight is not None:
                self._process(in_flight)
                in_flight = None
            step += 1
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        self.stats.seconds = time.perf_counter() - start
        self.stats.queue_seconds = self.runner.queue_seconds
        self.stats.offloads, self.stats.restores = (self.scheduler.offload_events,
                                                    self.scheduler.restore_events)
        (self.stats.graphs_recorded, self.stats.graph_record_seconds,
         self.stats.graph_record_compile_seconds) = self._graphs_recorded()
        return self.stats

    def _graphs_recorded(self) -> tuple[int, float, float]:
        """CUDA graphs recorded so far (the steps' and the refresh's), the seconds that took and
        the compiling in them."""
        tables = self.runner.graph_tables()
        return (sum(len(g.steps) for g in tables), sum(g.record_seconds for g in tables),
                sum(g.record_compile_seconds for g in tables))

    def _record_step(self, step: int, works: list[Work], scheduled: float) -> None:
        """Statistics of a step just launched (its works and selections are those it used)."""
        launched = time.perf_counter()
        kv_positions = kv_positions_read(works, self.runner.selection_len, self.spec.method)
        self.stats.steps += 1
        self.stats.tokens_per_step.append(sum(w.num_tokens for w in works))
        self.stats.kv_positions_per_step.append(kv_positions)
        kinds = [w.kind for w in works]
        self.stats.verifications_per_step.append(kinds.count("verify"))
        self.stats.drafts_per_step.append(kinds.count("draft"))
        if self.observers.on_step is not None:
            s = self.scheduler
            self.observers.on_step(StepEvent(
                step, works, list(s.running), list(s.offloaded), scheduled, launched - scheduled,
                kv_positions, *self._graphs_recorded(), self.stats.result_wait_seconds))

    # --- host bookkeeping of one step's results -------------------------------------------
    def _process(self, result: StepResult) -> None:
        start = time.perf_counter()
        got = result.fetch()
        self.stats.result_wait_seconds += time.perf_counter() - start
        refresh = []   # (index in result, request) whose critical positions change
        for i, w in enumerate(result.verify_works):
            seq = w.seq
            seq.results_in_flight -= 1
            if seq.status == Status.FINISHED:
                continue
            accepted, offered = got["num_accepted"][i], result.num_drafts[i]
            if w.kind == "verify":
                if offered > accepted:
                    self.cache.rollback(seq.seq_id, offered - accepted)
                # a draft made ahead of this result is the next cycle's first
                seq.num_drafts, seq.drafted_ahead = int(seq.drafted_ahead), False
                if offered:
                    for stats in (seq, self.stats):
                        stats.accepted_counts.append(accepted)
                    seq.drafts_per_verify.append(offered)
                    self.stats.drafts_offered.append(offered)
                    self.stats.verify_contexts.append(w.start)
                new_tokens = got["draft_tokens"][i][:accepted] + [got["next_token"][i]]
            else:          # the last prefill chunk: its row gives the first token
                seq.status = Status.RUNNING
                self.scheduler.assign_slot(seq)
                new_tokens = [got["next_token"][i]]
            self._commit(seq, new_tokens, accepted)
            if seq.status != Status.FINISHED and not seq.decodes_plainly:
                refresh.append((i, seq))
        selecting = time.perf_counter()
        self._refresh_drafting_state(result, refresh)
        done = time.perf_counter()
        self.stats.selection_seconds += done - selecting
        self.stats.process_seconds += done - start

    def _commit(self, seq: Sequence, new_tokens: list[int], accepted: int) -> None:
        params = seq.params
        if (len(seq.tokens) + len(new_tokens) < seq.token_limit and not params.stop
                and (params.ignore_eos or self.eos.isdisjoint(new_tokens))):
            seq.tokens += new_tokens            # the usual case: none of them ends the request
            committed, reason = new_tokens, None
        else:
            committed, reason = self._append_until_end(seq, new_tokens)
        drafted = min(accepted, len(committed))
        seq.commit_log.append((drafted, len(committed) - drafted))
        self.stats.output_tokens += len(committed)
        if self.observers.on_commit is not None:
            self.observers.on_commit(seq, committed, accepted)
        if reason:
            self.scheduler.finish(seq, reason)

    def _append_until_end(self, seq: Sequence,
                          new_tokens: list[int]) -> tuple[list[int], str | None]:
        """Append `new_tokens` to `seq` up to the first that ends it (EOS, max_new_tokens, the
        context's end, a stop string) -> (the tokens appended, "stop" / "length" or None)."""
        params, committed = seq.params, []
        for token in new_tokens:
            seq.tokens.append(token)
            committed.append(token)
            if token in self.eos and not params.ignore_eos:
                return committed, "stop"
            if seq.num_output >= params.max_new_tokens or len(seq.tokens) >= self.max_len:
                return committed, "length"
            if params.stop and self._hit_stop_string(seq):
                return committed, "stop"
        return committed, None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = self.decode_tail(seq.tokens[max(seq.num_prompt, len(seq.tokens) - (longest + 8)):])
        return any(s in tail for s in seq.params.stop)

    def _refresh_drafting_state(self, result: StepResult,
                                refresh: list[tuple[int, Sequence]]) -> None:
        """After a verification: the next cycle's critical positions (pillar, streaming; recorded
        with CUDA graphs where no observer watches them: refresh_graphs.py) or n-gram proposal."""
        if not refresh:
            return
        cfg, spec = self.model.config, self.spec
        seqs = [seq for _, seq in refresh]
        if spec.method in PILLAR_METHODS:
            works = result.verify_works
            fresh = [(i, seq) for i, seq in refresh if works[i].reselects]
            kept = [(i, seq) for i, seq in refresh if not works[i].reselects]
            if self.runner.refresh is not None and self.observers.on_selection is None:
                self.runner.refresh.run([seq for _, seq in fresh + kept],
                                        *self._scored_selections(result, fresh),
                                        *self._accepted_spans(result, fresh + kept))
            else:
                self._set_selections(result, fresh, kept)
            if spec.method == "pillar-lookup":
                self.runner.committed.send(seqs)
        elif spec.method == "streaming":
            chosen, widths = pillar_attn.stacked(
                [pillar_attn.select_streaming(seq.num_verified, spec.budget(seq.num_verified),
                                              spec.sink_tokens, cfg.num_layers, cfg.num_kv_heads,
                                              device=self.cache.device) for seq in seqs])
            self.runner.set_selections(seqs, chosen, widths)
            self._observe_selections(seqs, chosen, widths)
        elif spec.method == "ngram":
            for seq in seqs:
                seq.ngram_drafts = ngram.propose(seq.tokens, self.scheduler.draft_limit(seq),
                                                 spec.ngram_max, spec.ngram_min)

    def _scored_selections(self, result: StepResult, fresh: list[tuple[int, Sequence]]
                           ) -> tuple[torch.Tensor | None, list[int]]:
        """New selections [F, L, n_kv, N] (request b's first widths[b]) from the scores of the
        verifications (and last prefill chunks) of `fresh` (`Work.reselects`), and the widths."""
        if not fresh:
            return None, []
        spec, context = self.spec, [seq.num_verified for _, seq in fresh]
        chosen, widths = pillar_attn.top_positions(result.scores, context,
                                                   [spec.budget(c) for c in context],
                                                   [i for i, _ in fresh])
        return (pillar_attn.for_every_layer(chosen, spec.score_every, self.model.config.num_layers),
                widths)

    def _accepted_spans(self, result: StepResult, refresh: list[tuple[int, Sequence]]
                        ) -> tuple[list[int], list[int]]:
        """The positions each verification just accepted (its pending token's and its accepted
        drafts'), request b's first[b] .. first[b] + count[b] - 1 -> (first, count)."""
        works = [(result.verify_works[i], seq) for i, seq in refresh]
        spans = [(w.start, seq.num_verified - w.start) if w.kind == "verify" else (0, 0)
                 for w, seq in works]                    # (a last prefill chunk accepted none)
        return [first for first, _ in spans], [count for _, count in spans]

    def _set_selections(self, result: StepResult, fresh: list[tuple[int, Sequence]],
                        kept: list[tuple[int, Sequence]]) -> None:
        """Hand the runner the next selections in rank order (lookups displace the last ones):
        those of `fresh` (`_scored_selections`), and those of `kept` as they stand (their checks
        scored none), with the positions each verification just accepted ranked first when
        `keep_accepted` (`pillar_attn.keep_first`; `ModelRunner.keep_selections`)."""
        seqs = [seq for _, seq in fresh + kept]
        if fresh:
            chosen, widths = self._scored_selections(result, fresh)
            first, count = self._accepted_spans(result, fresh)
            if self.spec.keep_accepted and max(count):
                chosen = pillar_attn.keep_spans_first(chosen, widths, first, count)
            self.runner.set_selections(seqs[:len(fresh)], chosen, widths)
        if kept:
            self.runner.keep_selections(seqs[len(fresh):], *self._accepted_spans(result, kept))
        if self.observers.on_selection is not None:        # (with `kept`, all are in the runner)
            chosen, widths = self.runner.kept_selections(seqs) if kept else (chosen, widths)
            self._observe_selections(seqs, chosen, widths, result.scores if fresh else None,
                                     [i for i, _ in fresh])

    def _observe_selections(self, seqs: list[Sequence], chosen: torch.Tensor, widths: list[int],
                            scores: torch.Tensor | None = None, scored: list[int] = ()) -> None:
        """Hand each refreshed selection [L, n_kv, width] to `Observers.on_selection`, with the
        first F requests' scores: rows `scored` (F) of scores [Ls, Bs, n_kv, Lmax], cut to the
        request's context, a layer that scores none given those of the scored layer before it."""
        if self.observers.on_selection is None:
            return
        if scores is not None:
            scores = pillar_attn.for_every_layer(
                scores[:, to_device(scored, torch.long, self.cache.device)], self.spec.score_every,
                chosen.shape[1], 0)
        for b, (seq, width) in enumerate(zip(seqs, widths)):
            seq_scores = None if scores is None or b >= scores.shape[1] else \
                scores[:, b, :, :seq.num_verified]
            self.observers.on_selection(seq, seq_scores, chosen[b, ..., :width])
