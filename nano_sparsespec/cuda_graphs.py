"""Static-shape decode steps and their CUDA graphs: the fast GPU path (`cuda_graphs=True`, `--cuda-graphs`).

Why: at decode batch sizes a step is a few hundred small kernels (30 layers x norms, projections, RoPE, attention,
MLP, then sampling the drafts and verifying); launched one by one from Python, the GPU waits on the host. A CUDA
graph records a step's kernels once and replays them with one launch. What it records is the runner's whole device
step after the inputs are built (`ModelRunner._compute`: the forward, draft sampling, verification). A graph replays
fixed shapes and fixed addresses, so:

Owns
  * `Bucket`: the padded shape of a step — dense requests x query rows x context, sparse drafts x gathered entries,
    token rows, drafts sampled, checks verified (and their sampling flags). Sizes round up (`round_up`) so that a
    long generation needs a few dozen graphs, not one per step;
  * `StaticStep`: the static input tensors of one bucket, an `AttentionContext` pointing at them, and (on CUDA) the
    graph recorded over them. `load` copies a step's real tensors in and fills the rest with padding that computes
    harmless finite values: padding tokens write their K/V to the pool's scratch slot (`KVCache.scratch_slot`, the
    first slot of a block never handed to a request), padding queries attend to that slot only, and their outputs
    land in a padding token row; padding drafts and checks sample that row and write the runner's scratch row;
  * `StepGraphs.run(input_ids, positions, ctx, readout)`: what the runner calls instead of its `_compute` — pad,
    replay (or, on a CPU, run the padded step eagerly: the same shapes and padding, so the tests check the padding
    logic), and hand back the real checks' results and PillarAttn scores.

Steps with a prefill chunk keep the eager path (their query counts vary too much to bucket usefully).
Must not change what any real token computes: padding only adds rows and masked columns (tests: greedy equality).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .kv_cache import KVCache
from .model import CausalLM
from .pillar_attn import AttentionContext, DenseBatch, SparseBatch


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (torch's own tally of its compile calls).
    A graph's first, eager run is where a new step shape meets the compiled kernels: `StaticStep._record` notes how
    much of this fell inside recording."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(sum(times) for name, times in compilation_time_metrics.items() if name.endswith("compile_inner"))


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def batch_bucket(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8: small batches stay tight, large ones need few buckets."""
    return 0 if n == 0 else 1 << (n - 1).bit_length() if n <= 8 else round_up(n, 8)


@dataclass(frozen=True)
class Bucket:
    dense_batch: int             # Bd: requests attending densely (padded)
    dense_queries: int           # Qmax: query rows per dense request (1 plain decode, k + 1 verification)
    dense_context: int           # Lmax: context positions (padded, whole blocks)
    scores: bool                 # PillarAttn scores wanted
    sparse_batch: int            # Bs: draft tokens attending sparsely (padded)
    sparse_width: int            # S: gathered entries per draft (padded)
    drafts: int                  # Nd: draft tokens sampled (padded)
    checks: int                  # Bv: verifications (padded)
    check_drafts: int            # M: drafts per verification (its logit rows: M + 1)
    sampling: tuple              # the host flags of the drafts' and the checks' sampling

    @property
    def tokens(self) -> int:
        """Token rows: every padded dense query, every padded draft, and one more so padding always has a row."""
        return self.dense_batch * self.dense_queries + self.sparse_batch + 1

    @staticmethod
    def of(ctx: AttentionContext, readout, context_step: int, width_step: int) -> "Bucket":
        d, s, r = ctx.dense, ctx.sparse, readout
        checks = r.check_logit_rows
        return Bucket(batch_bucket(d.mask.shape[0]) if d else 0, d.mask.shape[1] if d else 0,
                      round_up(d.mask.shape[2], context_step) if d else 0, bool(d and d.score_weight is not None),
                      batch_bucket(s.valid.shape[0]) if s else 0, round_up(s.valid.shape[1], width_step) if s else 0,
                      batch_bucket(r.draft_row.shape[0]) if r.draft_row is not None else 0,
                      batch_bucket(checks.shape[0]) if checks is not None else 0,
                      checks.shape[1] - 1 if checks is not None else 0,
                      tuple((r.draft_flags or {}).items()) + tuple((r.check_flags or {}).items()))


class StaticStep:
    """Static inputs of one bucket, the context and readout that point at them, and the recorded graph (CUDA only).
    `readout` is the first step's (the runner's `Readout`): the static one copies its host flags."""

    def __init__(self, bucket: Bucket, model: CausalLM, cache: KVCache, graphs: "StepGraphs", readout):
        cfg, dev = model.config, cache.device
        long = dict(dtype=torch.long, device=dev)
        b = bucket
        self.bucket, self.graphs = bucket, graphs
        self.scratch_slot, self.pad_row = cache.scratch_slot, b.tokens - 1
        self.scratch_index = cache.scratch_slot * cfg.num_kv_heads          # the scratch slot, KV head 0, as a flat index
        self.input_ids = torch.zeros(b.tokens, **long)                                   # [Tp]
        self.positions = torch.zeros(b.tokens, **long)                                   # [Tp]
        self.scratch_block = cache.scratch_block
        self.ctx = AttentionContext(cache.k, cache.v, torch.zeros(b.tokens, **long), cache.block_size)  # slots [Tp]
        if b.dense_batch:
            Bd, Q, L = b.dense_batch, b.dense_queries, b.dense_context
            self.ctx.dense = DenseBatch(
                q_index=torch.zeros(Bd, Q, **long), q_valid=torch.zeros(Bd, Q, dtype=torch.bool, device=dev),
                valid_flat=torch.zeros(Bd * Q, **long), valid_rows=torch.zeros(Bd * Q, **long),
                block_table=torch.zeros(Bd, L // cache.block_size, **long),
                mask=torch.zeros(Bd, Q, L, dtype=torch.bool, device=dev), q_start=torch.zeros(Bd, **long))
            if b.scores:
                self.ctx.dense.score_weight = torch.zeros(Bd, Q, device=dev)
                self.ctx.dense.scores = torch.zeros(cfg.num_layers, Bd, cfg.num_kv_heads, L, device=dev)
        if b.sparse_batch:
            Bs, S = b.sparse_batch, b.sparse_width
            self.ctx.sparse = SparseBatch(q_index=torch.zeros(Bs, **long),
                                          kv_index=torch.zeros(cfg.num_layers, Bs, cfg.num_kv_heads, S, **long),
                                          valid=torch.zeros(Bs, S, dtype=torch.bool, device=dev))
        Nd, Bv, M = b.drafts, b.checks, b.check_drafts
        has_drafts, has_checks = readout.draft_row is not None, readout.check_row is not None
        self.readout = replace(
            readout,
            draft_logit_row=torch.zeros(Nd, **long) if has_drafts else None,                 # [Ndp]
            draft_row=torch.zeros(Nd, **long) if has_drafts else None,
            draft_index=torch.zeros(Nd, **long) if has_drafts else None,
            draft_position=torch.zeros(Nd, **long) if has_drafts else None,
            check_logit_rows=torch.zeros(Bv, M + 1, **long) if has_checks else None,         # [Bvp, M + 1]
            check_row=torch.zeros(Bv, **long) if has_checks else None,
            check_num_drafts=torch.zeros(Bv, **long) if has_checks else None,
            check_first_position=torch.zeros(Bv, **long) if has_checks else None,
            ngram_drafts=torch.zeros(Bv, M, **long) if readout.ngram_drafts is not None else None)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.packed: torch.Tensor | None = None                                          # [Bvp, 3 + M] graph output

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, readout) -> None:
        """Copy one step's tensors in; everything beyond them becomes padding."""
        pad_row = self.pad_row
        _put(self.input_ids, input_ids, 0)
        _put(self.positions, positions, 0)
        _put(self.ctx.slot_mapping, ctx.slot_mapping, self.scratch_slot)
        if ctx.dense is not None:
            d, sd = ctx.dense, self.ctx.dense
            Bd = d.mask.shape[0]
            _put(sd.q_index, d.q_index, pad_row)
            _put(sd.q_valid, d.q_valid, False)
            # Real query outputs go to their rows; the padding entries copy row 0's output into the padding row.
            _put(sd.valid_flat, d.valid_flat, 0)
            _put(sd.valid_rows, d.valid_rows, pad_row)
            _put(sd.block_table, d.block_table, self.scratch_block)
            _put(sd.mask, d.mask, False)
            sd.mask[Bd:, :, 0] = True                           # padding requests see one (scratch) position
            _put(sd.q_start, d.q_start, 0)                      # (q_start 0, no valid row: the same rule)
            if sd.score_weight is not None:
                _put(sd.score_weight, d.score_weight, 0.0)
        if ctx.sparse is not None:
            s, ss = ctx.sparse, self.ctx.sparse
            Bs = s.valid.shape[0]
            _put(ss.q_index, s.q_index, pad_row)
            _put(ss.kv_index, s.kv_index, self.scratch_index)
            _put(ss.valid, s.valid, False)
            ss.valid[Bs:, 0] = True                             # padding drafts see one (scratch) entry
        r, sr, scratch_row = readout, self.readout, self.graphs.scratch_row
        if r.draft_row is not None:                             # padding drafts: sampled from the padding token row,
            _put(sr.draft_logit_row, r.draft_logit_row, pad_row)                # written to the scratch row
            _put(sr.draft_row, r.draft_row, scratch_row)
            _put(sr.draft_index, r.draft_index, 0)
            _put(sr.draft_position, r.draft_position, 0)
        if r.check_row is not None:                             # padding checks: no drafts, the same rows
            _put(sr.check_logit_rows, r.check_logit_rows, pad_row)
            _put(sr.check_row, r.check_row, scratch_row)
            _put(sr.check_num_drafts, r.check_num_drafts, 0)
            _put(sr.check_first_position, r.check_first_position, 0)
            if sr.ngram_drafts is not None:
                _put(sr.ngram_drafts, r.ngram_drafts, 0)

    def run(self) -> torch.Tensor:
        """packed [Bvp, 3 + M] of the loaded step: replay the graph (recording it the first time) or run eagerly."""
        if self.input_ids.device.type != "cuda":
            return self._compute()
        if self.graph is None:
            self._record()
        self.graph.replay()
        return self.packed

    def _compute(self) -> torch.Tensor:
        return self.graphs.compute(self.input_ids, self.positions, self.ctx, self.readout)

    def _record(self) -> None:
        # A warm-up run on a side stream first (library handles, workspaces and compiled kernels are created outside
        # the capture). It computes the loaded step itself, so what it writes (K/V, drafts) the replay writes again.
        torch.cuda.synchronize()
        start, compiled = time.perf_counter(), compile_seconds()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._compute()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.graphs.memory_pool()):
            self.packed = self._compute()
        torch.cuda.synchronize()
        self.graphs.record_seconds += time.perf_counter() - start
        self.graphs.record_compile_seconds += compile_seconds() - compiled


def _put(static: torch.Tensor, real: torch.Tensor, fill) -> None:
    """static[:real.shape] = real, the rest = fill."""
    static.fill_(fill)
    static[tuple(slice(0, n) for n in real.shape)] = real


class StepGraphs:
    """One `StaticStep` per bucket met so far, for one model and one KV pool. `compute(input_ids, positions, ctx,
    readout) -> packed` is the runner's device step; `scratch_row` the row of its buffers that padding may write."""

    def __init__(self, model: CausalLM, cache: KVCache, compute: Callable, scratch_row: int,
                 context_step: int = 256, width_step: int = 32):
        self.model, self.cache, self.compute, self.scratch_row = model, cache, compute, scratch_row
        self.context_step, self.width_step = math.lcm(context_step, cache.block_size), width_step   # whole blocks
        self.steps: dict[Bucket, StaticStep] = {}
        self._pool = None
        self.record_seconds = 0.0            # wall time spent recording graphs (a one-time start-up cost)
        self.record_compile_seconds = 0.0    # ... of which torch.compile compiled for new shapes

    def memory_pool(self):
        """One memory pool for all these graphs: steps replay one at a time, so their scratch memory is shared."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, readout) -> torch.Tensor:
        """packed [Bv, 3 + M] for the step's real checks (valid until the next replay); ctx.dense.scores, when asked
        for, is filled as eager does."""
        bucket = Bucket.of(ctx, readout, self.context_step, self.width_step)
        step = self.steps.get(bucket)
        if step is None:
            step = self.steps[bucket] = StaticStep(bucket, self.model, self.cache, self, readout)
        step.load(input_ids, positions, ctx, readout)
        packed = step.run()
        if ctx.dense is not None and ctx.dense.scores is not None:
            Bd, _, L = ctx.dense.mask.shape
            ctx.dense.scores = step.ctx.dense.scores[:, :Bd, :, :L]
        checks = readout.check_row.shape[0] if readout.check_row is not None else 0
        return packed[:checks]
