"""Static-shape decode steps and their CUDA graphs: the fast GPU path (`--cuda-graphs`).

At decode batch sizes a step is a few hundred small kernels (per layer: norms, projections, RoPE,
attention, MLP; then draft sampling and verification), plus the few dozen that turn the step's
index lists into its attention batches; launched one by one from Python, the GPU waits on the
host. A CUDA graph records a step's kernels once and replays them with one launch. What it records
is the runner's whole device step from its uploaded lists (building the step's tensors, the
forward, draft sampling, verification), so a step costs the host one upload, one device copy and
one replay. A graph replays fixed shapes and fixed addresses, so:

Owns
  * the buckets: `StepGraphs.bucket` rounds a step's shape (the runner's `StepShape`: dense
    requests x query rows x context blocks, sparse drafts x critical positions + window, drafts
    sampled, checks verified, sampling flags) up to a batch size class and one context length,
    or to a recorded bucket that covers it (`covers`), or, while the batch grows, to the batch
    it grows into, so that a long generation needs a few dozen graphs, not one per step. The
    runner pads its lists to the bucket;
  * `StaticStep`: one bucket's static copy of the step's lists and (on CUDA) the graph recorded
    over them;
  * `Graphs.run(shape, packed, names)`: what the runner calls instead of its eager device step
    (and refresh_graphs.py instead of the eager selection refresh) — copy in, replay (or, on a
    CPU, run the padded step eagerly: the same shapes and padding, so the tests check the padding
    rules); `forget()` drops the graphs when a buffer they read is reallocated.

A step's prefill chunks are a static step of their own, bucketed as one run of chunks.
Must not change what any real token computes: padding only adds rows and masked columns.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import fields, replace
from typing import Callable

import torch

from .batch_invariant import ROW_TILE
from .device import Packed


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (torch's own tally): compiling, and
    choosing among a compiled kernel's Triton configurations by timing them at its first launch
    (a one-time cost that falls at run time, outside compiling).

    A graph's first, eager run is where a new step shape meets the compiled kernels, so recording
    notes how much of its time this was."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(sum(times) for name, times in compilation_time_metrics.items()
               if name.endswith("compile_inner") or name.startswith("CachingAutotuner."))


def round_up(n: int, step: int) -> int:
    """n rounded up to a multiple of `step`."""
    return -(-n // step) * step


# A bucket's token rows are a multiple of every device's matmul row tile, so that
# `batch_invariant.matmul` pads nothing: its pad is a fill and a copy before each of a layer's four
# matmuls, 8 of the 25 kernels of a layer in a plain decode step's graph otherwise.
TOKEN_TILE = max(ROW_TILE.values())


def bucket_tokens(dense_rows: int, sparse_batch: int) -> int:
    """A bucket's token rows: its dense requests' query rows, its drafts and the padding row (the
    last: what padded queries read), rounded up to `TOKEN_TILE` with more padding rows."""
    return round_up(dense_rows + sparse_batch + 1, TOKEN_TILE)


# Drafts that copy their draft-buffer rows out (few left) attend over N columns in two batched
# matmuls (those reading in place: flex_drafts.py). On the H200, cuBLAS's kernels for them take
# about a third longer when N % 128 lies in [8, 64] than at N % 128 = 72 (the embedded model's
# heads; BENCHMARKS.md), so a bucket's window takes the columns to reach that width; the draft
# buffers keep room for them (`DRAFT_WIDTH_PADDING`).
SLOW_DRAFT_WIDTHS = (8, 64)     # N % 128, both ends included
DRAFT_WIDTH_PADDING = 64


def fast_draft_width(columns: int) -> int:
    """The width the drafts' attention reads for `columns` (a multiple of 8): itself, or past
    `SLOW_DRAFT_WIDTHS` (at most `DRAFT_WIDTH_PADDING` more)."""
    low, high = SLOW_DRAFT_WIDTHS
    offset = columns % 128
    return columns + high + 8 - offset if low <= offset <= high else columns


def batch_bucket(n: int) -> int:
    """2, 4, 8, multiples of 8 up to 128, then eight sizes per doubling (144, 160, ..., 256, 288,
    ...): up to 128 at most 7 requests of padding, past it at most 12.5% (each padded
    verification runs k + 1 token rows), and a batch that shrinks from 1,024 to 0 meets 42 sizes
    (`covers` records few of them). A batch of one takes two: torch.compile specialises a size
    of 1, so it would compile apart."""
    if n <= 8:
        return 0 if n == 0 else max(2, 1 << (n - 1).bit_length())
    return round_up(n, max(8, 1 << ((n - 1).bit_length() - 4)))


class StaticStep:
    """One bucket's static inputs and, on CUDA, the graph of `compute` recorded over them.

    The inputs are a fixed copy of the step's packed lists, viewed by name."""

    def __init__(self, shape, packed: Packed, names: list[str], graphs: "Graphs"):
        self.shape, self.graphs = shape, graphs
        self.layout = _layout(packed, names)             # ((name, shape), ...) of the lists
        self.inputs = torch.zeros(packed.size(names), dtype=torch.long,
                                  device=packed.flat.device)   # [N]
        self.lists = packed.views(self.inputs, names)    # name -> a view of `inputs`
        self.warmed_up = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None                              # what the recorded `compute` returned

    def run(self, packed: Packed, names: list[str]):
        """The step's outputs: copy its lists in (one device copy), then replay the graph.

        The graph is recorded the first time. On a CPU, or with `Graphs.record` off, it runs
        `compute` eagerly on the same padded inputs, after the same warm-up run a recording makes
        first, so that the CPU tests check what a recording relies on."""
        layout = _layout(packed, names)
        if layout != self.layout:       # a bucket must fix the step's every list and its length
            raise RuntimeError(f"step lists {layout} do not fit the static step's {self.layout}")
        self.inputs.copy_(packed.flat[:self.inputs.shape[0]])
        if self.inputs.device.type != "cuda" or not self.graphs.record:
            if not self.warmed_up:
                self._warm_up()
            return self._compute()
        if self.graph is None:
            self._record()
        self.graph.replay()
        return self.outputs

    def _compute(self):
        return self.graphs.compute(self.shape, self.lists)

    def _warm_up(self) -> None:
        """Compute the loaded step once before recording it.

        Library handles, workspaces and compiled kernels are then created outside the capture. What
        it writes (K/V, drafts) the real run writes again; the state a step reads and rewrites
        (`Graphs.state`) is put back, so that the real run reads what this one read."""
        saved = [t.clone() for t in self.graphs.state]
        self._compute()
        for t, before in zip(self.graphs.state, saved):
            t.copy_(before)
        self.warmed_up = True

    def _record(self) -> None:
        """Warm up on a side stream, then capture `compute` into this bucket's graph."""
        torch.cuda.synchronize()
        start, compiled = time.perf_counter(), compile_seconds()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._warm_up()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: a dead reference cycle freed there that holds
        # pinned host memory (a step's result copy) makes the host allocator record an event on
        # the default stream, which invalidates the capture. Such cycles are freed by a later
        # collection, outside.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=self.graphs.memory_pool()):
                self.outputs = self._compute()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()
        self.graphs.record_seconds += time.perf_counter() - start
        self.graphs.record_compile_seconds += compile_seconds() - compiled


# a step's requests of each kind; a bucket may have more of them than its step (padding)
BATCH_FIELDS = ("tokens", "dense_batch", "sparse_batch", "drafts", "checks")


# a bucket with at most this many requests of each kind serves any smaller step: at that size a
# step costs about the same whatever its batch (weights and launches), and a run's tail records
# one bucket, not one per doubling
SMALL_BATCH = 64


def covers(recorded, wanted, most=None) -> bool:
    """Whether a step rounded to bucket `wanted` can replay bucket `recorded`: the same shape but
    for its batch sizes, each at least the step's and at most twice it (or `SMALL_BATCH`), or at
    most bucket `most`'s (`tokens` follows)."""
    if any(getattr(recorded, f.name) != getattr(wanted, f.name) for f in fields(wanted)
           if f.name not in BATCH_FIELDS):
        return False
    return all(getattr(wanted, name) <= getattr(recorded, name)
               <= (max(2 * getattr(wanted, name), SMALL_BATCH) if most is None
                   else getattr(most, name))
               for name in BATCH_FIELDS[1:])


def _layout(packed: Packed, names: list[str]) -> tuple:
    return tuple((name, packed.shapes[name]) for name in names)


class Graphs:
    """One `StaticStep` per bucket met so far, recorded into one memory pool (they replay one at
    a time, so they share it).

    `compute(shape, lists) -> outputs` is the device work recorded (it builds every tensor it
    needs from the named lists); `state` the tensors it may read and then rewrite (put back after
    the warm-up run)."""

    def __init__(self, compute: Callable, state: list[torch.Tensor]):
        self.compute, self.state = compute, state
        self.steps: dict = {}                # bucket -> its StaticStep
        self._pool = None
        self.record_seconds = 0.0            # wall time spent recording graphs (once, at start-up)
        self.record_compile_seconds = 0.0    # ... of which torch.compile compiled for new shapes
        self.on_record: Callable | None = None   # on_record(bucket) before a bucket is recorded
        # False: padded steps run eagerly, as on a CPU (the same kernels a replay runs, launched
        # from Python, so that hooks see each step: tools.parity)
        self.record = True

    def memory_pool(self):
        """The graphs' memory pool (taken by the first recording)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def run(self, shape, packed: Packed, names: list[str]):
        """The outputs of `compute(shape, lists)` for lists padded to `shape` (a bucket).

        `names` are the lists the work is built from (a leading part of `packed`). The outputs are
        valid until the next replay."""
        step = self.steps.get(shape)
        if step is None:
            if self.on_record is not None:
                self.on_record(shape)
            step = self.steps[shape] = StaticStep(shape, packed, names, self)
        return step.run(packed, names)

    def forget(self) -> None:
        """Drop every recorded graph (a buffer they read was reallocated); buckets record anew."""
        self._drop_steps()

    def release(self) -> None:
        """Drop every recorded graph and `compute` once no step will run: a recorded step refers
        back to these graphs and `compute` to their owner, whose memory that cycle would hold
        until the collector next runs."""
        self._drop_steps()
        self.compute = None

    def _drop_steps(self) -> None:
        if self.steps and torch.cuda.is_available():
            torch.cuda.synchronize()         # no replay in flight reads what is dropped
        self.steps.clear()
        # a pool that no graph holds is released: the next graphs take a new one
        self._pool = None


class StepGraphs(Graphs):
    """The decode steps' graphs: `Graphs` of the runner's device step, and its buckets.

    `compute` is the runner's device step (it builds every tensor of the step from the named
    lists and runs it); `block_size` the KV pool's; `state` the tensors a step may read and then
    rewrite (the runner's draft tokens: a plain step that runs ahead reads the token in flight and
    writes its own in the same place); `rows` the runner's request rows; `speculates`: whether the
    engine's checks verify drafts (every method but plain decoding)."""

    def __init__(self, compute: Callable, block_size: int, state: list[torch.Tensor], rows: int,
                 stride: int = 1, budget: Callable[[int], int] | None = None,
                 context_step: int = 256, width_step: int = 32, speculates: bool = True,
                 lookups: int = 0):
        super().__init__(compute, state)
        self.rows, self.stride = rows, stride
        self.lookups = lookups               # draft-buffer columns between selection and window
        self.speculates = speculates
        self.block_size, self.budget = block_size, budget
        # dense context: whole blocks
        self.context_step = math.lcm(context_step, block_size)
        self.width_step = width_step
        self.served: dict = {}               # rounded shape -> the recorded bucket that covers it

    def bucket(self, shape, growth: float = 1.0):
        """The bucket a step is padded to: its own (`rounded`), or a recorded one that covers it
        with at most twice its requests of each kind, or at most `SMALL_BATCH` (`covers`): a
        shrinking batch (a run's tail) records one bucket per doubling down to that size, not
        one per size. A growing batch (a run's start: `growth` times as many requests will
        decode once the prefilling and waiting ones are in) is padded up to the batch ahead
        (`ahead`): a few steps padded, where each size on the way would record a graph and
        compile its kernels."""
        own = self.rounded(shape)
        if own in self.steps or own.dense_runs:
            return own
        if growth >= 1.25:
            most = self.ahead(shape, own, growth)
            covering = [b for b in self.steps if covers(b, own, most)]
            return min(covering, key=lambda b: b.tokens) if covering else most
        if own not in self.served:                     # looked up once per bucket
            covering = [b for b in self.steps if covers(b, own)]
            if not covering:
                return own
            self.served[own] = min(covering, key=lambda b: b.tokens)
        return self.served[own]

    def ahead(self, shape, own, growth: float):
        """Bucket `own` (of step `shape`) with the step's requests of each kind times `growth`."""
        sizes = {name: max(batch_bucket(math.ceil(getattr(shape, name) * growth)),
                           getattr(own, name)) for name in BATCH_FIELDS[1:]}
        return replace(own, tokens=bucket_tokens(sizes["dense_batch"] * own.dense_queries,
                                                 sizes["sparse_batch"]), **sizes)

    def rounded(self, shape):
        """The runner's `StepShape` of a step rounded up to its own bucket.

        A step of prefill chunks (run apart from the rest of their step) is one run of all its
        chunks, each padded to the longest rounded up to a power of two, at least 64 rows: a few
        buckets then cover all prompts.

        The batch sizes round with `batch_bucket`. The rest follows one context length (the dense
        context or the lookups' verified tokens, whichever is longer, rounded to 256 positions):
        the dense batch's blocks, the lookups' width and the drafts' selection width (at least
        the budget at that context, rounded to `width_step`). Verifications have k + 1 query rows
        and k drafts whatever they check, drafts a window of at least k, so that the steps of one
        context share one bucket. A speculating engine's checks all have k drafts and k + 1 rows (a
        last prefill chunk's, none: padded), so that one compiled verification serves every step.
        A step of plain decodes alone (the plain tail) keeps one query row a request: with k + 1,
        its few requests would run the token rows of a busy step's verifications.

        A draft step reads every row of the draft buffers (up to the scratch row), or a copy of
        its drafts' rows where they are under a third of them (`attention.gathered`),
        selection_width + lookups + window (rounded to 8) columns of each, which the runner rounds
        to a multiple of 8: each row of the sparse kernel's logits and probabilities then starts
        16-byte aligned, which keeps cuBLAS off its slow fallback kernels. The window (at least
        k) also takes the columns that bring that width to a fast one (`fast_draft_width`)."""
        s, k = shape, self.stride
        dense_batch, sparse_batch = batch_bucket(s.dense_batch), batch_bucket(s.sparse_batch)
        # one context length for the dense batch and the lookups
        context = round_up(max(s.dense_blocks * self.block_size, s.lookup_context),
                           self.context_step)
        blocks = context // self.block_size if s.dense_blocks else 0
        selection = s.selection_width
        if selection and context and self.budget is not None:   # the budget at that context
            selection = max(selection, self.budget(context))
        queries, runs = s.dense_queries, ()
        speculative_checks = s.checks and self.speculates
        plain_decodes = s.check_drafts == 0 and s.sparse_batch == 0     # (the plain tail)
        if s.dense_runs:
            queries = max(64, 1 << (queries - 1).bit_length())
            runs = ((0, dense_batch, queries, blocks, True),)
        elif queries > 1 or (speculative_checks and not plain_decodes):   # verifications: k + 1
            queries = max(queries, k + 1)                              # rows, whatever they check
        check_drafts = max(s.check_drafts, k) if speculative_checks else s.check_drafts
        selection = round_up(selection, self.width_step)
        window = 0
        if s.window:   # at least k, and reaching a fast width (`fast_draft_width`)
            window = round_up(max(s.window, k), 8)
            columns = round_up(selection + self.lookups + window, 8)
            window = fast_draft_width(columns) - selection - self.lookups
        return replace(s, tokens=bucket_tokens(dense_batch * queries, sparse_batch),
                       dense_batch=dense_batch,
                       dense_queries=queries, dense_blocks=blocks, dense_runs=runs,
                       sparse_batch=sparse_batch,
                       sparse_rows=self.rows if s.sparse_rows else 0,
                       selection_width=selection, window=window,
                       lookup_context=context if s.lookup_context else 0,
                       drafts=batch_bucket(s.drafts), checks=batch_bucket(s.checks),
                       check_drafts=check_drafts)

    def context(self, bucket) -> int:
        """The context length a bucket serves (dense or lookup context, whichever is longer)."""
        return max(bucket.dense_blocks * self.block_size, bucket.lookup_context)

    def forget(self) -> None:
        super().forget()
        self.served.clear()
