"""cuda_graphs.py: bucket sizes, and decoding through padded static steps (what a CUDA graph replays) is lossless:
every drafter's greedy output equals plain greedy decoding on the same path. On a CPU the padded steps run eagerly,
which checks every padding rule, each bucket's first step after the warm-up run a recording makes (plain decoding
that runs ahead fails if that run's writes leak into the real one); on a GPU they are recorded and replayed as CUDA
graphs.

Why "on the same path": padding changes the shapes of the matrix products (a 1-row product becomes a 2-row one),
and BLAS may round those differently in the last bit (measured: ~1e-6 in hidden states, fp32). Greedy equality is
exact only between runs whose arithmetic is the same, so the padded drafters are compared with padded plain decoding;
eager against eager is tests/test_engine.py."""
import functools
from dataclasses import replace

import pytest
import torch

from conftest import generate
from nano_sparsespec import LLM, SamplingParams, attention, kernels, verifier
from nano_sparsespec import paged as paged_kernel
from nano_sparsespec.config import SpecConfig
from nano_sparsespec.batch_invariant import ROW_TILE
from nano_sparsespec.cuda_graphs import (DRAFT_WIDTH_PADDING, TOKEN_TILE, StepGraphs, batch_bucket, fast_draft_width,
                                        round_up)
from nano_sparsespec.flex_drafts import drafts_by_reading, flex_drafts
from nano_sparsespec.runner import ModelRunner
from nano_sparsespec.step_lists import StepLists

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_bucket_sizes():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 128, 129, 900)] == \
        [0, 2, 2, 4, 8, 8, 16, 16, 24, 64, 72, 128, 144, 960]
    assert len({batch_bucket(n) for n in range(1, 1025)}) == 42
    assert all(n <= batch_bucket(n) <= max(n + 7, 1.125 * n) for n in range(1, 1025))
    assert [round_up(n, 256) for n in (1, 256, 257)] == [256, 256, 512]


def test_fast_draft_widths():
    """The drafts' attention widths that cuBLAS handles slowly (N % 128 in [8, 64]) move to N % 128 = 72; others
    stay."""
    assert [fast_draft_width(n) for n in (128, 136, 160, 192, 200, 256, 264, 320, 328, 384, 392)] == \
        [128, 200, 200, 200, 200, 256, 328, 328, 328, 384, 456]
    assert all(n <= fast_draft_width(n) <= n + DRAFT_WIDTH_PADDING for n in range(8, 4096, 8))


def test_steps_of_a_context_share_a_bucket():
    """Mixed steps whose contexts lie in the same 256 positions share one bucket whatever their verifications check
    (k + 1 query rows, k drafts; checks of no drafts too), their drafts' windows and selections (the budget at that
    context) and which of the dense context and the lookups is longer: the bucket key is the batch and one context
    length."""
    from nano_sparsespec.step_lists import StepShape
    k, budget = 8, lambda n: max(128, -(-n // 20))
    graphs = StepGraphs(None, block_size=16, state=[], rows=1024, stride=k, budget=budget)

    def shape(verify_tokens, window, selection, dense_blocks, lookup_context):
        return StepShape(tokens=112 * verify_tokens + 900, dense_batch=112, dense_queries=verify_tokens,
                         dense_blocks=dense_blocks, scores=True, sparse_batch=900, sparse_rows=1024,
                         selection_width=selection, window=window, lookup_context=lookup_context, drafts=900,
                         checks=112, check_drafts=verify_tokens - 1, draft_flags=(), check_flags=())
    shapes = [shape(9, 8, 150, 3000 // 16, 2990), shape(6, 3, 131, 2900 // 16, 3050), shape(2, 1, 128, 3050 // 16, 0)]
    buckets = {graphs.bucket(s) for s in shapes[:2] + [shape(1, 8, 150, 3000 // 16, 2990)]}
    assert len(buckets) == 1
    bucket, = buckets
    # a window of k, widened so that the drafts read 200 columns, not 168 (`fast_draft_width`)
    assert (bucket.dense_queries, bucket.check_drafts, bucket.window) == (k + 1, k, 40)
    assert (bucket.dense_blocks * 16, bucket.lookup_context, bucket.selection_width) == (3072, 3072, 160)
    assert graphs.bucket(shapes[2]).dense_blocks == bucket.dense_blocks

    # a recorded bucket serves a smaller batch of the same shape with at most twice its requests of each kind
    graphs.steps[bucket] = None
    fewer = replace(shapes[0], dense_batch=60, checks=60, sparse_batch=450, drafts=450)
    assert graphs.bucket(fewer) == bucket
    too_few = replace(fewer, dense_batch=40, checks=40)
    assert graphs.bucket(too_few) == graphs.rounded(too_few) != bucket


def test_a_step_of_plain_decodes_keeps_one_query_row_a_request():
    """In a speculating engine a step of plain decodes alone (the plain tail: checks of no drafts, no drafts) is
    bucketed with one query row a request, not a verification's k + 1, which would give its few requests the token
    rows of a busy step's verifications; its checks keep k drafts (one compiled verification). A step that checks
    drafts, or drafts, keeps k + 1 rows."""
    from nano_sparsespec.step_lists import StepShape
    k = 8
    graphs = StepGraphs(None, block_size=16, state=[], rows=512, stride=k, budget=lambda n: 128)
    tail = StepShape(tokens=6, dense_batch=5, dense_queries=1, dense_blocks=4000 // 16, scores=False, sparse_batch=0,
                     sparse_rows=0, selection_width=0, window=0, lookup_context=0, drafts=0, checks=5, check_drafts=0,
                     draft_flags=(), check_flags=())
    bucket = graphs.bucket(tail)
    assert (bucket.dense_batch, bucket.dense_queries, bucket.check_drafts, bucket.checks) == (8, 1, k, 8)
    assert bucket.tokens == round_up(8 + 1, TOKEN_TILE)
    checking_drafts = replace(tail, tokens=15, dense_queries=3, check_drafts=2)
    assert graphs.bucket(checking_drafts).dense_queries == k + 1
    drafting = replace(tail, tokens=10, sparse_batch=4, sparse_rows=512, selection_width=128, window=3, drafts=4)
    assert graphs.bucket(drafting).dense_queries == k + 1


def test_a_bucket_s_token_rows_are_whole_matmul_tiles(monkeypatch):
    """A bucket's token rows (its requests' rows and the padding row, the last) are a whole number of every device's
    matmul row tile, so that the layers' matmuls pad nothing: a pad is a fill and a copy before each of them, two more
    kernels each in the step's graph."""
    from nano_sparsespec import batch_invariant
    from nano_sparsespec.step_lists import StepShape
    graphs = StepGraphs(None, block_size=16, state=[], rows=1024, stride=8, budget=lambda n: max(128, -(-n // 20)))
    pads = []
    monkeypatch.setattr(batch_invariant.F, "pad", lambda x, *args, **kwargs: pads.append(x.shape) or x)
    for dense, queries, sparse in ((512, 1, 0), (1000, 1, 0), (57, 9, 455), (114, 9, 910), (3, 64, 0), (0, 1, 7)):
        real = dense * queries + sparse
        bucket = graphs.rounded(StepShape(
            tokens=real + 1, dense_batch=dense, dense_queries=queries, dense_blocks=64, scores=False,
            sparse_batch=sparse, sparse_rows=1024 if sparse else 0, selection_width=128 if sparse else 0,
            window=8 if sparse else 0, lookup_context=0, drafts=sparse, checks=dense, check_drafts=8 if sparse else 0,
            draft_flags=(), check_flags=()))
        dense_rows, sparse_rows = bucket.dense_batch * bucket.dense_queries, bucket.sparse_batch
        assert dense_rows + sparse_rows + 1 <= bucket.tokens < dense_rows + sparse_rows + 1 + TOKEN_TILE
        assert all(bucket.tokens % tile == 0 for tile in ROW_TILE.values())
        batch_invariant.matmul(torch.ones(bucket.tokens, 4), torch.ones(4, 3))
    assert pads == []


def test_a_growing_batch_is_padded_to_the_batch_ahead():
    """While requests are still coming in (`growth` > 1.25), a step is padded up to the batch it grows into, or
    replays a recorded bucket between its own and that one: a batch that grows from 30 to 512 in steps of 20 records
    one bucket, where its own sizes would record 20. A batch about to be full or shrinking pads to its own (when no
    recorded bucket covers it)."""
    from nano_sparsespec.step_lists import StepShape
    graphs = StepGraphs(None, block_size=16, state=[], rows=512, stride=8, speculates=False)

    def decode(batch):
        return StepShape(tokens=batch + 1, dense_batch=batch, dense_queries=1, dense_blocks=16, scores=False,
                         sparse_batch=0, sparse_rows=0, selection_width=0, window=0, lookup_context=0, drafts=0,
                         checks=batch, check_drafts=0, draft_flags=(), check_flags=())
    for batch in range(30, 513, 20):
        bucket = graphs.bucket(decode(batch), growth=512 / batch)
        assert bucket.dense_batch >= batch and bucket.checks >= batch and bucket.tokens == round_up(bucket.dense_batch + 1, TOKEN_TILE)
        graphs.steps.setdefault(bucket, None)                                       # "recorded"
    assert {b.dense_batch for b in graphs.steps} == {512}
    assert len({graphs.rounded(decode(batch)).dense_batch for batch in range(30, 513, 20)}) == 20
    graphs.forget()
    assert graphs.bucket(decode(420), growth=512 / 420).dense_batch == 448                 # less than 1.25x ahead
    assert graphs.bucket(decode(200)).dense_batch == 208                                   # shrinking


def test_the_progress_bar_says_which_graph_is_recorded(tiny_qwen3, prompts, capsys):
    """With a progress bar, each bucket's recording is announced before it starts (torch.compile may compile for
    seconds meanwhile): its number, batch and context against the longest context of the run."""
    llm = LLM(str(tiny_qwen3[0]), device="cpu", dtype="float32", cuda_graphs=True, max_batch=5)
    llm.generate(None, SamplingParams(max_new_tokens=8, ignore_eos=True), prompt_token_ids=prompts, progress=True)
    err = capsys.readouterr().err
    longest = max(len(p) for p in prompts) + 8
    assert "recording CUDA graph 1: batch" in err and f" of {longest:,}" in err
    assert f"{llm.last_stats.graphs_recorded} CUDA graphs recorded in" in err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,policy,async_verify,kv_blocks,options", [
    ("pillar", "naive", False, None, {}), ("pillar", "balanced", True, 12, {}),
    ("pillar", "balanced", True, 12, {"refresh_every": 2}),
    ("pillar-lookup", "balanced", False, None, {}), ("pillar-lookup", "balanced", True, 12, {"score_every": 2}),
    ("streaming", "balanced", True, None, {}), ("ngram", "naive", True, None, {}),
    ("full", "balanced", False, None, {}), ("plain", "balanced", True, 12, {})])
def test_padded_steps_are_lossless(tiny_qwen3, prompts, device, method, policy, async_verify, kv_blocks, options):
    _, plain = generate(tiny_qwen3[0], prompts, device=device, cuda_graphs=True, method="plain", max_batch=5)
    llm, outs = generate(tiny_qwen3[0], prompts, device=device, cuda_graphs=True, method=method, stride=4,
                         min_budget=8, budget_ratio=0.1, batch_policy=policy, async_verify=async_verify,
                         kv_blocks=kv_blocks, block_size=16, max_batch=5, prefill_chunk=32, **options)
    assert outs == plain


def test_padded_draft_steps_of_few_drafts_read_copies_of_their_rows(tiny_qwen3, prompts, monkeypatch):
    """With many more slots than drafts (8 requests, 32 slots), a padded draft step reads copies of its drafts' rows
    of the draft buffers (`attention.gathered`), not every row: the drafts, so every verification's accepted count,
    are those of the same run reading every row in place, and the output equals padded plain decoding's."""
    from nano_sparsespec import runner
    seen, options = set(), dict(cuda_graphs=True, method="pillar-lookup", stride=4, min_budget=8, budget_ratio=0.1,
                                block_size=16, max_batch=32)

    def noted(drafts, rows_read):
        seen.add(attention.gathered(drafts, rows_read))
        return attention.gathered(drafts, rows_read)
    _, plain = generate(tiny_qwen3[0], prompts, cuda_graphs=True, method="plain", max_batch=32)
    monkeypatch.setattr(runner, "gathered", noted)
    copied, outs = generate(tiny_qwen3[0], prompts, **options)
    monkeypatch.setattr(runner, "gathered", lambda drafts, rows_read: False)
    in_place, outs_in_place = generate(tiny_qwen3[0], prompts, **options)
    assert seen == {True} and outs == outs_in_place == plain
    assert copied.last_stats.accepted_counts == in_place.last_stats.accepted_counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the paged kernel is compiled for the GPU alone")
@pytest.mark.parametrize("method,async_verify,options", [("pillar", True, {}), ("pillar-lookup", False, {}),
                                                       ("pillar-lookup", True, {"score_every": 2, "refresh_every": 2}),
                                                       ("pillar-lookup", True, {"plain_tail": 0.5})])
def test_compiled_fast_path_is_lossless(tiny_qwen3, prompts, tmp_path, monkeypatch, method, async_verify, options):
    """The whole fast path on the GPU (CUDA graphs, the compiled paged kernel whose verifications score through the
    swapped pass, compiled elementwise pieces and sampling): greedy speculation equals plain decoding, float32; with
    `plain_tail` 0.5 the last two requests decode plainly, in steps of one query row a request."""
    from nano_sparsespec import model as model_module, verifier
    monkeypatch.setenv("NANO_SPARSESPEC_CACHE", str(tmp_path))
    try:
        _, plain = generate(tiny_qwen3[0], prompts, device="cuda", cuda_graphs=True, compile=True, method="plain",
                            max_batch=5)
        _, outs = generate(tiny_qwen3[0], prompts, device="cuda", cuda_graphs=True, compile=True, method=method,
                           stride=4, min_budget=8, budget_ratio=0.1, batch_policy="balanced",
                           async_verify=async_verify, kv_blocks=12, block_size=16, max_batch=5, prefill_chunk=32,
                           **options)
    finally:
        kernels.use_eager_kernels()
        model_module.use_eager_elementwise()
        verifier.use_eager_sampling()
    assert outs == plain


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_drafts_read_aligned_widths(tiny_qwen3, prompts, monkeypatch, cuda_graphs):
    """A draft step reads a multiple of 8 columns of the draft buffers (rows of the sparse kernel's logits start
    16-byte aligned; unaligned, cuBLAS fell back to slow kernels on the H200), eager or padded, whatever its
    selections, lookups (2 columns here) and windows; padded, a fast width (`fast_draft_width`)."""
    widths = []
    sparse_batch = ModelRunner._sparse_batch

    def noted(self, shape, dev, *inputs):
        batch = sparse_batch(self, shape, dev, *inputs)
        widths.append((shape.selection_width + self.lookups + shape.window, batch.valid.shape[-1]))
        return batch

    monkeypatch.setattr(ModelRunner, "_sparse_batch", noted)
    generate(tiny_qwen3[0], prompts[:3], SamplingParams(max_new_tokens=24, ignore_eos=True), cuda_graphs=cuda_graphs,
             method="pillar-lookup", lookup_matches=1, stride=4, min_budget=9, budget_ratio=0.1, max_batch=3)
    if cuda_graphs:   # a bucket's window takes it to a fast width, an aligned one
        assert all(fast_draft_width(width) == width for _, width in widths), widths
    else:
        assert any(wanted % 8 for wanted, _ in widths), widths              # some steps want an unaligned width
    assert all(width % 8 == 0 and wanted <= width < wanted + 8 for wanted, width in widths), widths


@pytest.mark.parametrize("async_verify", [False, True])
def test_padded_step_computes_what_eager_computes(tiny_qwen3, prompts, monkeypatch, async_verify):
    """Every padded step (its tensors built from padded lists, forward, draft sampling, verification) against the
    eager step of the same plan at its own shape: the same verification results, drafts and pending positions,
    PillarAttn scores within rounding; with delayed verification, drafts ahead of their verifications' results too."""
    worst = {"scores": 0.0, "steps": 0, "drafts": 0, "ahead": 0}
    run = ModelRunner._run

    def both(self, plan, shape, static):
        if not static:
            return run(self, plan, shape, static)
        # the eager step writes the same K/V and drafts that the padded step then writes again; a verification also
        # leaves its next token where a request running or drafting ahead reads it (after its accepted drafts), so
        # the padded step starts from the draft tokens the eager one found
        drafts_before = self.draft_tokens.clone()
        eager, eager_scores = run(self, plan, self.step_lists.shape(plan), False)
        eager, eager_drafts, eager_pending = eager.clone(), self.draft_tokens.clone(), self.pending_position.clone()
        eager_scores = None if eager_scores is None else eager_scores.clone()
        self.draft_tokens.copy_(drafts_before)
        packed, scores = run(self, plan, shape, True)
        assert torch.equal(packed[:, :eager.shape[1]], eager)   # a bucket's checks carry k drafts, read to their own
        assert torch.equal(self.draft_tokens[:-1], eager_drafts[:-1])      # all but the scratch row
        assert torch.equal(self.pending_position[:-1], eager_pending[:-1])
        worst["ahead"] += sum(w.ahead for w in plan.works)
        assert (scores is None) == (eager_scores is None)
        if scores is not None:
            L = eager_scores.shape[-1]
            assert not scores[..., L:].any()                                   # padding columns score 0
            worst["scores"] = max(worst["scores"], (scores[..., :L] - eager_scores).abs().max().item())
        worst["steps"] += 1
        worst["drafts"] += len(plan.drafts)
        return packed, scores

    monkeypatch.setattr(ModelRunner, "_run", both)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    generate(tiny_qwen3[0], prompts, params, cuda_graphs=True, method="pillar", stride=4, min_budget=8,
             budget_ratio=0.1, batch_policy="balanced", max_batch=5, async_verify=async_verify)
    assert worst["steps"] > 20 and worst["drafts"] > 20 and (worst["ahead"] > 5) == async_verify
    assert worst["scores"] < 1e-6, worst


@pytest.mark.parametrize("chunk,exact", [(paged_kernel.PAGED_CHUNK, False), (16, False),
                                         (paged_kernel.PAGED_CHUNK, True)])
def test_paged_kernels_are_lossless(tiny_qwen3, prompts, monkeypatch, chunk, exact):
    """The GPU's paged path (flex_attention reading the pool through a block mask), run here as torch's uncompiled
    reference, with padded steps: padding requests all point at the scratch block. Greedy speculation on it equals
    plain decoding on it, with every context cut at the same positions into chunks of PAGED_CHUNK positions (these
    contexts lie in the first) or of one block, merged by their logsumexps. The number of chunks is a power of two
    (a few compilations cover every context length); with exact rows, every step cuts the longest context the block
    tables hold (33 blocks of 16) into the most chunks, and lists no block full. Small batches are padded to a power
    of two with requests that see nothing."""
    monkeypatch.setattr(paged_kernel, "PAGED_CHUNK", chunk)
    monkeypatch.setattr(paged_kernel, "exact_rows", exact)
    calls, splits, full_lists = [], [], []

    def counted(out, q, q_index, k_layer, v_layer, block_mask, *scored):
        calls.append(q_index.shape[1])                  # query rows per request: 1 plain decoding, k + 1 verification
        splits.append(block_mask.kv_num_blocks.shape[0] // q_index.shape[0])            # chunks per context
        full_lists.append(block_mask.full_kv_num_blocks is not None)
        scoring.append(bool(scored))
        paged_kernel.paged_dense(out, q, q_index, k_layer, v_layer, block_mask, *scored)
    scoring = []
    monkeypatch.setitem(attention._kernels, "paged", counted)
    monkeypatch.setitem(attention._kernels, "prepare", paged_kernel.paged_prepare)
    monkeypatch.setitem(attention._kernels, "sparse", drafts_by_reading(attention.sparse_drafts, flex_drafts))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)     # (torch's reference flex_attention is slow)
    _, plain = generate(tiny_qwen3[0], prompts, params, cuda_graphs=True, method="plain", max_batch=5, block_size=16)
    _, outs = generate(tiny_qwen3[0], prompts, params, cuda_graphs=True, method="pillar", stride=4, min_budget=8,
                       budget_ratio=0.1, batch_policy="balanced", async_verify=True, kv_blocks=12, block_size=16,
                       max_batch=5, prefill_chunk=32)
    assert outs == plain
    assert {1, 5} <= set(calls) and set(scoring) == {False, True}       # verifications scored by the paged kernel
    assert set(splits) == ({2} if exact else {16} if chunk == 16 else {1})
    assert set(full_lists) == {not exact}


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unavailable")
def test_a_speculating_run_compiles_its_verification_and_draft_attention_once(tiny_qwen3, prompts, monkeypatch):
    """Through padded static steps the compiled verification meets one layout in a whole run at a temperature
    (first tokens, requests admitted while others verify, a tail of one request): every check of a speculating
    engine has k drafts (a last prefill chunk's none of them) and their distributions, a batch of one is padded to
    two, and the checks' logits start the LM head's product. torch.compile specialises sizes 0 and 1, a storage
    offset of 0 and a missing tensor: each would compile it again (seconds on a GPU). The draft attention is traced
    without duck sizing (a step of drafts alone has as many token rows as the draft buffers have rows). Draft
    sampling compiles once: its logits never start the product (a step without checks leads with a spare row), and it
    is traced without duck sizing (their storage offset may be one row of the vocabulary). So are pillar-lookup's
    draft columns."""
    from nano_sparsespec.tools.measure import CompiledFrames
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    kernels.compile_sampling()
    kernels.compile_kernels()
    try:
        with CompiledFrames() as compiled:
            params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
            llm, _ = generate(tiny_qwen3[0], prompts, params, cuda_graphs=True, method="pillar-lookup", stride=4,
                              min_budget=8, budget_ratio=0.1, batch_policy="balanced", async_verify=True,
                              max_batch=3, prefill_chunk=32)
    finally:
        verifier.use_eager_sampling()
        kernels.use_eager_kernels()
    assert llm.last_stats.graphs_recorded > 5
    names = ("_verify_logits", "sparse_drafts", "_sample_drafts", "lookup_lists", "lookup_columns")
    assert {name: compiled.frames[name][0] for name in names} == dict.fromkeys(names, 1), compiled.frames


def test_contexts_are_cut_into_as_many_chunks_as_the_longest_needs():
    """The paged kernel's chunk count: as many chunks of PAGED_CHUNK positions as the longest context needs, rounded up
    to a power of two and at most what the longest possible context needs; no more than bring the batch's CTAs
    (requests x KV heads x chunks) to PAGED_CTAS, with chunks twice, four times ... as long instead. One chunk is the
    whole table at its widest."""
    chunk = paged_kernel.PAGED_CHUNK // 64                                       # blocks of 64 positions per chunk
    # a single head: as many as the longest context needs, up to the 17 that cover 129 blocks
    assert [paged_kernel.paged_chunks(blocks, 129, 64, 1) for blocks in (1, 8, 9, 24, 33, 100, 129)] == \
        [(129, 1), (129, 1), (chunk, 2), (chunk, 4), (chunk, 8), (chunk, 16), (chunk, 17)]
    ctas = paged_kernel.PAGED_CTAS
    # a batch of ctas / 4 heads: up to 4 chunks; then chunks of 2, 4, 8 x PAGED_CHUNK (the last: 3 cover 129 blocks)
    assert [paged_kernel.paged_chunks(blocks, 129, 64, ctas // 4) for blocks in (8, 24, 33, 100, 129)] == \
        [(129, 1), (chunk, 4), (2 * chunk, 4), (4 * chunk, 4), (8 * chunk, 3)]
    assert {paged_kernel.paged_chunks(blocks, 129, 64, ctas) for blocks in (1, 24, 129)} == {(129, 1)}   # enough CTAs
    assert paged_kernel.paged_chunks(100, 129, 64, ctas // 3) == (4 * chunk, 4)                      # 4 x 341 >= 1024


def test_verifications_cut_their_contexts_into_half_as_many_chunks():
    """A batch of several query rows a request (verifications: each CTA serves k + 1 rows from a key load) aims at
    CHECK_CTAS, half of PAGED_CTAS: 64 requests x 3 KV heads attend in 4 chunks, not 8; 128 in 2, not 4."""
    chunk = paged_kernel.PAGED_CHUNK // 64
    assert paged_kernel.CHECK_CTAS == paged_kernel.PAGED_CTAS // 2
    assert [paged_kernel.paged_chunks(65, 129, 64, requests * 3) for requests in (64, 128)] == \
        [(2 * chunk, 8), (4 * chunk, 4)]
    assert [paged_kernel.paged_chunks(65, 129, 64, requests * 3, rows=9) for requests in (64, 128)] == \
        [(4 * chunk, 4), (8 * chunk, 2)]


def test_small_batches_attend_in_the_class_of_the_usual_step(monkeypatch):
    """The paged kernel attends a batch of at most SMALL_BATCH requests padded to a power of two, at least the dense
    batch of the engine's usual step (a balanced step's verifications, one request in k + 1): a run's start and tail
    then compile no batch classes of their own."""
    monkeypatch.setattr(paged_kernel, "smallest_kernel_batch", paged_kernel.smallest_kernel_batch)   # restored after
    paged_kernel.set_smallest_kernel_batch(SpecConfig(method="pillar-lookup", max_batch=512).dense_batch())     # 57
    assert [paged_kernel.kernel_batch(n) for n in (1, 2, 33, 57, 64, 65, 128, 129, 512)] == \
        [64, 64, 64, 64, 64, 128, 128, 129, 512]
    paged_kernel.set_smallest_kernel_batch(SpecConfig(method="plain", max_batch=512).dense_batch())
    assert paged_kernel.kernel_batch(1) == paged_kernel.SMALL_BATCH
    paged_kernel.set_smallest_kernel_batch(SpecConfig(method="pillar-lookup", max_batch=16).dense_batch())      # 2
    assert [paged_kernel.kernel_batch(n) for n in (1, 2, 3, 5)] == [2, 2, 4, 8]


def test_growing_budgets_do_not_drop_recorded_graphs(tiny_qwen3, prompts, monkeypatch):
    """The critical positions' buffer is sized once for the longest context the requests can reach: as budgets grow
    over a generation (from the prompt's length to past the 32 columns a bucket rounds to, here), no recorded graph
    is dropped (each drop means recording again)."""
    dropped, budgets = [], set()
    forget, set_selections = StepGraphs.forget, ModelRunner.set_selections

    def counted_forget(self):
        dropped.append(len(self.steps))
        forget(self)

    def noted_selections(self, seqs, positions, widths):
        budgets.update(widths)
        set_selections(self, seqs, positions, widths)

    monkeypatch.setattr(StepGraphs, "forget", counted_forget)
    monkeypatch.setattr(ModelRunner, "set_selections", noted_selections)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    generate(tiny_qwen3[0], prompts[:4], params, cuda_graphs=True, method="pillar", stride=4, min_budget=8,
             budget_ratio=0.2, max_batch=4)
    assert len(budgets) > 5 and max(budgets) > 32, budgets
    assert not any(dropped), dropped


def test_a_static_step_refuses_lists_of_another_layout():
    """A bucket fixes every list of its steps and their lengths: lists that do not fit raise instead of being read
    at the wrong offsets (the table changes after them vary freely)."""
    from nano_sparsespec.device import Packed
    graphs = StepGraphs(lambda shape, lists: lists["ids"] * 2, block_size=4, state=[], rows=8)
    first = Packed({"ids": [1, 2, 3], "rows": [[4, 5]], "table_changes": [[0, 1, 2]]})
    assert graphs.run("bucket", first, ["ids", "rows"]).tolist() == [2, 4, 6]
    changed = Packed({"ids": [7, 8, 9], "rows": [[1, 1]], "table_changes": [[0, 1, 2], [1, 2, 3]]})
    assert graphs.run("bucket", changed, ["ids", "rows"]).tolist() == [14, 16, 18]
    with pytest.raises(RuntimeError, match="do not fit"):
        graphs.run("bucket", Packed({"ids": [1, 2], "rows": [[4, 5, 6]]}), ["ids", "rows"])


def test_eager_steps_have_a_padding_row_only_when_they_pad(tiny_qwen3, prompts, monkeypatch):
    """A padding row is a whole token's work (on a CPU a batch of one takes twice as long with it), so an eager step
    has one only when a dense request has fewer query rows than the longest (a prefill chunk beside decoding)."""
    seen = {True: 0, False: 0}
    shape_of = StepLists.shape

    def noted(self, plan):
        shape = shape_of(self, plan)
        real = sum(w.num_tokens for w in plan.works)
        ragged = len({w.num_tokens for w, _ in plan.dense}) > 1
        assert shape.tokens == real + ragged
        seen[ragged] += 1
        return shape

    monkeypatch.setattr(StepLists, "shape", noted)
    generate(tiny_qwen3[0], prompts, method="plain", max_batch=5, prefill_chunk=32)
    assert seen[True] and seen[False]


def test_prefill_chunks_run_as_a_static_step_of_their_own(tiny_qwen3, prompts, monkeypatch):
    """With CUDA graphs every part of a step is a padded static step: a step's prefill chunks run apart from its
    decoding requests (one bucketed run of chunks), and the two parts' results are joined in check order. Requests
    admitted while others verify make steps whose both parts have checks (a last prefill chunk and verifications),
    and the output equals plain decoding's on the same path; in those steps each check's row of the joined results
    is its own: the verifications' first, all as wide (a speculating engine's checks all have k draft columns; a
    prefill's offers none of them)."""
    parts, joined = [], []
    run, launch = ModelRunner._run, ModelRunner.launch

    def noted_run(self, plan, shape, static):
        kinds = {w.kind for w in plan.works}
        assert static and (kinds == {"prefill"} or "prefill" not in kinds), (static, kinds)
        if kinds == {"prefill"}:
            assert shape.dense_queries >= 64 and len(shape.dense_runs) == 1, shape
        parts.append(bool(plan.checks))
        return run(self, plan, shape, static)

    def noted_launch(self, works, growth=1.0):
        before = len(parts)
        result = launch(self, works, growth)
        if parts[before:] == [True, True]:
            joined.append(([w.kind for w in result.verify_works], result.num_drafts, result.fetch()))
        return result

    monkeypatch.setattr(ModelRunner, "_run", noted_run)
    monkeypatch.setattr(ModelRunner, "launch", noted_launch)
    _, plain = generate(tiny_qwen3[0], prompts, cuda_graphs=True, method="plain", max_batch=3)
    _, outs = generate(tiny_qwen3[0], prompts, cuda_graphs=True, method="pillar", stride=4, min_budget=8,
                       budget_ratio=0.1, async_verify=True, max_batch=3, prefill_chunk=32)
    assert outs == plain
    assert joined                                       # some steps had checks in both parts
    for kinds, num_drafts, got in joined:
        assert kinds.index("prefill") == kinds.count("verify") > 0        # the decoding part's checks come first
        width = len(got["draft_tokens"][0])
        for kind, n, accepted, bonus, drafts in zip(kinds, num_drafts, got["num_accepted"], got["is_bonus"],
                                                    got["draft_tokens"]):
            assert len(drafts) == width >= n and 0 <= accepted <= n and bonus == (accepted == n)
            assert kind == "verify" or n == accepted == 0                 # a first token's row: no drafts

