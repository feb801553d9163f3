"""How many CUDA-graph buckets a bench row records, counted on the host alone (no GPU, no model math),
where its slot-steps go when every request accepts alike, or as differently as a measured row's requests,
how much of its steps' shapes is padding, and what the host's work costs a step.

The engine, scheduler, bucketing and the runner's host side of a step (its lists, their packing, the block
tables' changes) run as they do on the GPU; no graph is replayed, and the step's results are made up: each
request accepts each draft with probability 0.97 (about 7 of 8, as pillar-lookup does), or with `spread` with a
probability of each request's own, drawn so that its mean accepted count follows the quantiles of the H200
pillar-lookup row's requests (`SPREAD`, linear between them), and selects the budget's first positions.
Prompts of 60-250 tokens, greedy, every request writes all its tokens. Slot-steps: a request drafts or verifies
(busy), sits out a step while its verification is in flight (stall), waits for its verify slot or its prefill, or
the slot holds no request (empty). Padding: the share of the key positions the verifications' score pass gathers
(the bucket's dense batch x its longest context) and of the positions the drafts attend to (its sparse batch x
(widest selection + widest window)) past each request's own; and of the token rows the layers run, over all steps
and over those with under an eighth of the batch working (the drain). Host milliseconds a step: the mean and the median
over the steps that give at least 95% of the batch work, the median split into scheduling and launching it, and
the rest of the loop (processing the step before's results), leaving out the time this script spends making up
results and counting slot-steps and padding; device buffers are not touched, and the selection refresh's few
tensor operations, which a GPU only launches, compute here on the CPU.

    python benchmarks/count_graph_buckets.py BATCH REQUESTS TOKENS [METHOD [POLICY [uniform|spread [REFRESH]]]]
    python benchmarks/count_graph_buckets.py 1024 2048 4096 pillar-lookup balanced spread
"""
import random
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nano_sparsespec import LLM, SamplingParams, async_loop, cuda_graphs
from nano_sparsespec import paged as paged_kernel
from nano_sparsespec.runner import ModelRunner


# (quantile, mean accepted of 8) of the requests of the H200 pillar-lookup row +async, 1,024 x 4,096,
# package 5baa36c (accepted_by_request's min, p10, median, p90, max; bc30af1's row in
# results/h200-1024x4096-lookup.json spreads alike: 4.20, 6.46, 6.97, 7.44, 7.90)
SPREAD = ((0.0, 3.93), (0.1, 6.42), (0.5, 6.95), (0.9, 7.48), (1.0, 7.94))


def mean_accepted(p: float, k: int = 8) -> float:
    """Mean accepted drafts of k when each is accepted with probability p (until the first rejection)."""
    return sum(p ** j for j in range(1, k + 1))


def drawn_acceptance(rng: random.Random) -> float:
    """A per-draft acceptance probability whose mean accepted count is drawn from `SPREAD`."""
    u = rng.random()
    (u0, a0), (u1, a1) = next((lo, hi) for lo, hi in zip(SPREAD, SPREAD[1:]) if u <= hi[0])
    target = a0 + (a1 - a0) * (u - u0) / (u1 - u0)
    low, high = 0.0, 1.0
    for _ in range(40):                                       # bisection: mean_accepted grows with p
        middle = (low + high) / 2
        if mean_accepted(middle) < target:
            low = middle
        else:
            high = middle
    return low


class BucketCounter(ModelRunner):
    """A runner that does the host's part of each step, notes its bucket and makes up plausible
    results."""
    rng = random.Random(0)
    recorded = set()
    acceptance: dict = {}          # seq_id -> its per-draft acceptance probability (spread)
    spread = False
    made_up_seconds = 0.0          # spent making up results: not the host's work, left out of it
    # positions (bucketed shape, the requests' own) the score pass gathers keys of, a whole
    # context a scored dense row, and that the drafts attend to, selection and window a draft
    gathered, sparse = Counter(), Counter()
    token_rows = []                # per step: (requests working, its own token rows, its bucket's)

    def _run(self, plan, shape, static):
        super()._run(plan, shape, static)                     # lists, packing, table changes
        started = time.perf_counter()
        self.recorded.add(shape)
        self.token_rows.append((len(plan.dense) + len(plan.sparse),
                                sum(w.num_tokens for w, _ in plan.dense) + len(plan.sparse), shape.tokens))
        if shape.scores:
            bs = self.cache.block_size
            self.gathered["shape"] += shape.dense_batch * shape.dense_blocks * bs
            self.gathered["own"] += sum(-(-(w.start + w.num_tokens) // bs) * bs for w, _ in plan.dense)
        if shape.sparse_batch:
            self.sparse["shape"] += shape.sparse_batch * (shape.selection_width + shape.window)
            self.sparse["own"] += sum(self.selection_len[w.seq.row] + w.start - w.seq.num_verified + 1
                                      for w, _ in plan.sparse)
        width = max(plan.num_drafts, default=0)
        rows = []
        for (work, _), drafts in zip(plan.checks, plan.num_drafts):
            p = 0.97
            if self.spread:
                if work.seq.seq_id not in self.acceptance:
                    self.acceptance[work.seq.seq_id] = drawn_acceptance(self.rng)
                p = self.acceptance[work.seq.seq_id]
            accepted = 0
            while accepted < drafts and self.rng.random() < p:
                accepted += 1
            rows.append([accepted, 7, int(accepted == drafts)] + [7] * width)
        packed = torch.tensor(rows, dtype=torch.long).view(len(rows), 3 + width)
        BucketCounter.made_up_seconds += time.perf_counter() - started
        return packed, (torch.zeros(1, len(rows), 1, 1) if shape.scores else None)

    def set_selections(self, seqs, positions, widths):
        for seq, width in zip(seqs, widths):
            self.selection_len[seq.row] = width

    def set_context_tokens(self, seqs):
        pass


def replay_nothing(graphs, shape, packed, names):
    """`StepGraphs.run` that notes the bucket "recorded" and returns zeros of its outputs' shapes."""
    graphs.steps[shape] = None
    scores = torch.zeros(1, shape.dense_batch, 1, 1) if shape.scores else None
    return torch.zeros(shape.checks, 3 + shape.check_drafts, dtype=torch.long), scores


def note_refresh(graphs, shape, packed, names):
    """`Graphs.run` of the recorded selection refresh: notes the bucket "recorded", runs nothing."""
    graphs.steps[shape] = None


BLOCK_SIZE = 64          # the KV block size of the bench rows
CONTEXT_CAPACITY = 8192  # positions a block table holds: the embedded model's context length
KV_HEADS = 3             # the embedded model's (the paged kernel's chunks follow its CTAs)


def first_positions(scores, context, budgets, rows=None):
    return torch.zeros(len(budgets), 1, 1, max(budgets), dtype=torch.long), list(budgets)


def host_only_llm(runner_class, **options) -> LLM:
    """An engine with CUDA graphs whose runner is `runner_class` (a `BucketCounter`), over a one-layer model with the
    embedded model's context length (buckets depend on nothing else of it): no graph replays, selections are the
    budget's first positions."""
    path = tempfile.mkdtemp()
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1,
                                 max_position_embeddings=CONTEXT_CAPACITY, eos_token_id=255)).save_pretrained(path)
    async_loop.pillar_attn.top_positions = first_positions
    cuda_graphs.StepGraphs.run = replay_nothing
    cuda_graphs.Graphs.run = note_refresh
    llm = LLM(path, cuda_graphs=True, runner_class=runner_class, **options)
    paged_kernel.set_smallest_kernel_batch(llm.spec.dense_batch())     # as LLM(compile=True) sets it
    return llm


def workload(requests: int, tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 60-250 random tokens and, one a request (its seed, as the bench gives them), SamplingParams that
    write all `tokens`."""
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(rng.randint(60, 250))] for _ in range(requests)]
    return prompts, [SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=i) for i in range(requests)]


def main() -> None:
    batch, requests, tokens = (int(x) for x in sys.argv[1:4])
    method = sys.argv[4] if len(sys.argv) > 4 else "pillar-lookup"
    policy = sys.argv[5] if len(sys.argv) > 5 else "balanced"
    BucketCounter.spread = len(sys.argv) > 6 and sys.argv[6] == "spread"
    refresh_every = int(sys.argv[7]) if len(sys.argv) > 7 else 1      # `SpecConfig.refresh_every`
    llm = host_only_llm(BucketCounter, method=method, batch_policy=policy, max_batch=batch,
                        async_verify=policy == "balanced", refresh_every=refresh_every)
    prompts, params = workload(requests, tokens)
    slot_steps, host = Counter(), []       # host: (seconds since the step before, launching)
    last = [None]

    def count_slots(event):
        now, made_up = time.perf_counter(), BucketCounter.made_up_seconds
        if last[0] is not None and len(event.works) >= 0.95 * batch:
            host.append((now - last[0] - made_up, event.launch_seconds - made_up))
        BucketCounter.made_up_seconds = 0.0
        working = {id(w.seq) for w in event.works}
        slot_steps["busy"] += len(working)
        slot_steps["empty"] += batch - len(event.running) - len(event.offloaded)
        for seq in event.running + event.offloaded:
            if id(seq) not in working:
                slot_steps["stall" if seq.awaiting_result else "wait"] += 1
        last[0] = time.perf_counter()              # (this count is not the host's work either)

    llm.generate(None, params, prompt_token_ids=prompts, on_step=count_slots)
    print(f"{method} {policy}, refresh_every {refresh_every}, batch {batch}, "
          f"{requests} requests x {tokens} tokens: "
          f"{llm.last_stats.graphs_recorded} buckets over {llm.last_stats.steps} steps, "
          f"{len(paged_kernel_shapes(BucketCounter.recorded))} shapes of the paged kernel and "
          f"{len(score_pass_shapes(BucketCounter.recorded))} of its score pass (a compilation each)")
    total, accepted = batch * llm.last_stats.steps, llm.last_stats.accepted_counts
    print("slot-steps: " + ", ".join(f"{kind} {slot_steps[kind] / total:.1%}"
                                     for kind in ("busy", "stall", "wait", "empty"))
          + (f"; mean accepted {statistics.mean(accepted):.2f}" if accepted else ""))
    padding = [f"{1 - c['own'] / c['shape']:.1%} of {what}"
               for c, what in ((BucketCounter.gathered, "the keys the score pass gathers"),
                               (BucketCounter.sparse, "the positions drafts attend to")) if c]
    if padding:
        print("padding past the requests' own contexts and selections: " + ", ".join(padding))
    for what, steps in (("all steps", BucketCounter.token_rows),
                        ("steps with under an eighth of the batch working",
                         [t for t in BucketCounter.token_rows if t[0] < batch / 8])):
        if steps:
            own, rows = (sum(t[i] for t in steps) for i in (1, 2))
            print(f"token rows, {what} ({len(steps)}): {rows / len(steps):.0f} a step, {1 - own / rows:.1%} padding")
    if host:
        whole, launch = (1e3 * statistics.median(t) for t in zip(*host))
        mean = 1e3 * statistics.mean(t for t, _ in host)   # (with the collector's occasional passes)
        print(f"host a step ({len(host)} steps with 95% of the batch working): mean {mean:.2f} ms; median "
              f"{whole:.2f}, scheduling and launching {launch:.2f}, the rest (processing results) "
              f"{whole - launch:.2f}")


def paged_kernel_shapes(buckets) -> set:
    """The shapes torch.compile specialises the paged kernel on (`paged.paged_prepare`):
    the batch class `paged.kernel_batch`, query rows, chunks of the context (blocks per chunk
    and count), scored or not."""
    capacity = -(-CONTEXT_CAPACITY // BLOCK_SIZE) + 1        # a block table's width (runner.py)
    return {(paged_kernel.kernel_batch(b.dense_batch), b.dense_queries,
             paged_kernel.batch_chunks((b.dense_batch, b.dense_blocks), capacity, BLOCK_SIZE,
                                       KV_HEADS, b.dense_queries), b.scores)
            for b in buckets if b.dense_batch and not b.dense_runs}


def score_pass_shapes(buckets) -> set:
    """The shapes the verification's score pass is compiled for (`swapped_scores.score_pass`): query
    rows (its batch and context are dynamic)."""
    return {b.dense_queries for b in buckets if b.scores and b.dense_batch and not b.dense_runs}


if __name__ == "__main__":
    main()
