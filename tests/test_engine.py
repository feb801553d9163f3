"""The engine end to end on a tiny random Qwen3: losslessness across every drafter and system setting, batching,
scheduler invariants, offload, bad input. Greedy outputs must match plain greedy decoding token for token."""
import itertools

import numpy as np
import pytest
import torch

from conftest import GREEDY, PROMPT_LENGTHS, run
from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.config import SpecConfig
from nano_sparsespec.step_result import StepResult, joined_results


def test_batch_equals_each_prompt_alone(tiny_qwen3, prompts, plain_greedy):
    llm = LLM(str(tiny_qwen3[0]), method="plain")
    alone = [llm.generate(None, GREEDY, prompt_token_ids=[p])[0].token_ids for p in prompts]
    assert alone == plain_greedy
    assert all(len(t) == GREEDY.max_new_tokens for t in alone)


CASES = list(itertools.product(("pillar", "streaming", "ngram", "full"), ("naive", "balanced"), (False, True),
                               (None, 12)))


@pytest.mark.parametrize("method,policy,async_verify,kv_blocks", CASES)
def test_greedy_speculation_is_lossless(tiny_qwen3, prompts, plain_greedy, method, policy, async_verify, kv_blocks):
    # max_batch 5 < 8 prompts: later requests are admitted while others decode. kv_blocks=12 (of 16 tokens) cannot
    # hold all running requests, so whole requests move to the host pool and back.
    llm, outs = run(tiny_qwen3[0], prompts, method=method, stride=4, min_budget=8, budget_ratio=0.1,
                    batch_policy=policy, async_verify=async_verify, kv_blocks=kv_blocks, block_size=16, max_batch=5,
                    prefill_chunk=32)
    assert [o.token_ids for o in outs] == plain_greedy
    if kv_blocks is not None:
        assert llm.last_stats.offloads > 0 and llm.last_stats.restores == llm.last_stats.offloads


@pytest.fixture(scope="module")
def plain_greedy_bf16(tiny_qwen3, prompts):
    _, outs = run(tiny_qwen3[0], prompts, dtype="bfloat16", method="plain", max_batch=5, block_size=16,
                  prefill_chunk=32)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", ["pillar", "pillar-lookup", "streaming", "ngram", "full"])
@pytest.mark.parametrize("policy,async_verify", [("naive", False), ("balanced", True)])
def test_greedy_speculation_is_lossless_in_bfloat16(tiny_qwen3, prompts, plain_greedy_bf16, method, policy,
                                                    async_verify):
    """In bfloat16 a last-place difference flips greedy text at the first near-tie: lossless only because each
    verification row is computed with the arithmetic of the decode row of its position (batch_invariant.py)."""
    _, outs = run(tiny_qwen3[0], prompts, dtype="bfloat16", method=method, stride=4, min_budget=8,
                  budget_ratio=0.1, batch_policy=policy, async_verify=async_verify, block_size=16, max_batch=5,
                  prefill_chunk=32)
    assert [o.token_ids for o in outs] == plain_greedy_bf16


def test_prefill_chunks_are_attended_apart(tiny_qwen3, prompts, plain_greedy, monkeypatch):
    """A step that prefills some requests while others decode attends the chunks apart (`StepShape.dense_runs`): the
    decoding requests are attended with their one query row, not padded to a chunk's, and the chunks in runs that pad
    at most 2x their query rows. Output equals plain greedy decoding."""
    from nano_sparsespec import attention as attention_module
    from nano_sparsespec.step_lists import StepLists
    attention, shape, steps = attention_module.dense_attention, StepLists.shape, []

    def planned(self, plan):
        kinds = [w.kind for w, _ in plan.dense]
        steps.append({"decoding": kinds.count("verify"), "calls": [],
                      "chunks": [w.num_tokens for w, _ in plan.dense if w.kind == "prefill"]})
        return shape(self, plan)

    def recorded(q, k, v, mask):
        steps[-1]["calls"].append(tuple(q.shape[:2]))                   # (requests, query rows) of one call
        return attention(q, k, v, mask)
    monkeypatch.setattr(StepLists, "shape", planned)
    monkeypatch.setattr(attention_module, "dense_attention", recorded)
    _, outs = run(tiny_qwen3[0], prompts, method="plain", max_batch=5, block_size=16, prefill_chunk=32)
    assert [o.token_ids for o in outs] == plain_greedy
    mixed = [s for s in steps if s["decoding"] and s["chunks"]]
    assert len(mixed) >= 3
    layers = tiny_qwen3[1].config.num_hidden_layers
    assert any(len(s["calls"]) > 2 * layers for s in mixed)             # chunks of unlike lengths apart too
    for s in mixed:
        decoding, *chunk_runs = s["calls"][:len(s["calls"]) // layers]  # the first layer's
        assert decoding == (s["decoding"], 1)
        assert sum(n for n, _ in chunk_runs) == len(s["chunks"])
        assert sum(n * q for n, q in chunk_runs) <= 2 * sum(s["chunks"])


def test_dense_runs_group_prefill_chunks_by_length():
    """`StepLists._dense_runs`: the other dense requests in one run, then the chunks (longest first) cut into runs
    wherever a chunk is less than half its run's first; each run's query rows and context blocks are its own, and
    runs of chunks are marked `prefill`. A step without chunks attends as one batch (no runs)."""
    from types import SimpleNamespace
    from nano_sparsespec.scheduler import Work
    from nano_sparsespec.step_lists import StepLists

    def works(kind, spans):
        return [Work(None, kind, start, n) for start, n in spans]
    runner = SimpleNamespace(cache=SimpleNamespace(block_size=16))
    decoding = works("verify", [(40, 1), (100, 9), (7, 1)])
    chunks = works("prefill", [(0, 32), (64, 20), (0, 15), (0, 8), (16, 3)])
    assert StepLists._dense_runs(runner, decoding + chunks) == (
        (0, 3, 9, 7, False), (3, 2, 32, 6, True), (5, 2, 15, 1, True), (7, 1, 3, 2, True))
    assert StepLists._dense_runs(runner, decoding) == ()
    assert StepLists._dense_runs(runner, works("prefill", [(0, 32), (0, 17)])) == ((0, 2, 32, 2, True),)
    assert StepLists._dense_runs(runner, works("prefill", [(0, 32), (0, 15)])) == (
        (0, 1, 32, 2, True), (1, 1, 15, 1, True))


def test_each_token_row_finds_its_work():
    """`work_of_row`: the work of each token row, as `repeat_interleave` of the works' token counts gives it, for works
    of one and of many rows in any mix, and a step of one work."""
    from nano_sparsespec.step_lists import work_of_row

    rng = np.random.default_rng(0)
    for counts in ([1], [9], [1, 1, 9, 1, 3], list(rng.integers(1, 10, size=200))):
        counts = torch.tensor(counts)
        first_row = torch.cumsum(counts, 0) - counts
        expected = torch.repeat_interleave(torch.arange(len(counts)), counts)
        assert torch.equal(work_of_row(first_row, int(counts.sum())), expected), counts


def test_a_step_s_sampling_flags_are_those_of_all_its_requests():
    """`StepShape.draft_flags`: `SamplingTensors.host_flags` of every drafting request's params, in any order and
    mix of greedy, sampled and filtered requests (a greedy request's top-k is ignored), two requests of each kind."""
    from dataclasses import replace
    from types import SimpleNamespace
    from nano_sparsespec.scheduler import Sequence, Work
    from nano_sparsespec.step_lists import StepLists, StepPlan
    from nano_sparsespec.verifier import SamplingTensors

    kinds = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9),
             SamplingParams(top_k=5)]
    lists = StepLists(SpecConfig(method="pillar"), SimpleNamespace(block_size=16), scratch_row=8)
    orders = itertools.chain.from_iterable(itertools.permutations(range(4), n) for n in range(1, 5))
    for order in orders:
        params = [replace(kinds[j], seed=copy) for j in order for copy in range(2)]
        seqs = [Sequence(row, [1, 2, 3], p, seed=row, row=row) for row, p in enumerate(params)]
        shape = lists.shape(StepPlan.of([Work(s, "draft", 3, 1) for s in seqs], "pillar"))
        assert shape.draft_flags == tuple(SamplingTensors.host_flags(params).items()), order


@pytest.mark.parametrize("stride", [1, 4, 8])
def test_strides(tiny_qwen3, prompts, plain_greedy, stride):
    _, outs = run(tiny_qwen3[0], prompts, method="pillar", stride=stride, min_budget=8, budget_ratio=0.1)
    assert [o.token_ids for o in outs] == plain_greedy


SAMPLED = [SamplingParams(temperature=1.0, top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i // 2 % 2], seed=i,
                          max_new_tokens=40, ignore_eos=True) for i in range(len(PROMPT_LENGTHS))]


@pytest.mark.parametrize("method,sampled", [("full", False), ("full", True), ("pillar", False),
                                            ("pillar-lookup", True), ("streaming", False)])
def test_drafts_that_see_the_whole_context_are_all_accepted(tiny_qwen3, prompts, method, sampled):
    """A draft that attends to every position computes what the verification computes: `full` drafts, and sparse
    drafts whose budget covers the context (every position critical, plus those written since the verification). The
    verifier then accepts every draft, greedy or sampled (T = 1, with top-k and top-p): a sampled draft is accepted
    with probability min(1, p(x) / q(x)) = 1 when its draft distribution q is passed on as the target's p.
    In float32 on any device: the draft's attention rounds differently from the verification's (it is not row-invariant
    arithmetic), and in bfloat16 that flips tokens at a top-k or nucleus boundary (a GPU's default dtype)."""
    llm, _ = run(tiny_qwen3[0], prompts, SAMPLED if sampled else GREEDY, method=method, stride=4, min_budget=128,
                 dtype="float32")
    stats = llm.last_stats
    assert len(stats.accepted_counts) > 50 and stats.accepted_counts == stats.drafts_offered


@pytest.mark.parametrize("method,async_verify,kv_blocks", [("pillar", False, None), ("pillar", True, 12),
                                                           ("ngram", False, 12)])
def test_rejected_drafts_are_rolled_back(tiny_qwen3, prompts, plain_greedy, method, async_verify, kv_blocks):
    """After every processed verification (and last prefill chunk) the request's cache holds exactly its verified
    positions and the blocks they need: rejected drafts' KV is forgotten and their emptied blocks return to the pool.
    Checked where the engine hands over committed tokens (`on_commit`): that request then has no step in flight, also
    with delayed verification (it sits out the step launched meanwhile, or drafts ahead of the result: then the cache
    also holds that draft's position). kv_blocks=12 adds offload and restore."""
    from nano_sparsespec.async_loop import Engine, Observers
    from nano_sparsespec.kv_cache import KVCache
    from nano_sparsespec.model import load_model
    from nano_sparsespec.scheduler import Sequence

    model = load_model(str(tiny_qwen3[0]), torch.device("cpu"), torch.float32)
    cfg, block_size = model.config, 16
    spec = SpecConfig(method=method, stride=4, min_budget=4, budget_ratio=0.01, async_verify=async_verify,
                      kv_blocks=kv_blocks, block_size=block_size, max_batch=5)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_blocks or 64, block_size, torch.float32, "cpu",
                    host_blocks=64 if kv_blocks else 0)
    engine = Engine(model, spec, cache, eos_token_ids=set())
    seqs = [Sequence(i, p, GREEDY, seed=i) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    seen = []

    def check(seq, tokens, accepted):
        n = seq.num_verified + seq.num_drafts                              # (a draft ahead, or none)
        seen.append((seq.seq_id, cache.length(seq.seq_id), len(cache.block_table(seq.seq_id)), n,
                     -(-n // block_size)))
    stats = engine.run(Observers(on_commit=check))
    assert [s.output_ids for s in seqs] == plain_greedy
    assert sum(stats.accepted_counts) < sum(stats.drafts_offered)          # drafts were rejected: rollbacks ran
    assert len(seen) >= len(stats.accepted_counts) + len(prompts)        # each verification and first token
    bad = [(i, length, blocks) for i, length, blocks, n, need in seen if (length, blocks) != (n, need)]
    assert not bad, bad[:5]
    if kv_blocks is not None:
        assert stats.offloads > 0
    assert cache.free_blocks() == cache.pool.num_blocks                    # every block back once all finished


@pytest.mark.parametrize("method,async_verify", [("pillar", False), ("pillar-lookup", True)])
def test_selections_are_copied_through_up_to_date_device_tables(tiny_qwen3, prompts, plain_greedy, monkeypatch,
                                                                method, async_verify):
    """`ModelRunner.set_selections` copies the K/V of a request's selected positions (and a draft ahead's pending
    one) through the runner's device block tables, not the host's: at every call those rows hold the host's blocks for
    each position it reads, also with delayed verification, drafts ahead, and a pool that offloads (kv_blocks=12)."""
    from nano_sparsespec.runner import ModelRunner
    checked = []
    set_selections = ModelRunner.set_selections

    def checked_selections(self, seqs, positions, widths):
        for seq in seqs:
            table, read = self.cache.block_table(seq.seq_id).tolist(), seq.num_verified + (1 if seq.num_drafts else 0)
            blocks = -(-read // self.cache.block_size)
            checked.append(len(table) >= blocks and self.block_tables[seq.row, :blocks].tolist() == table[:blocks])
        return set_selections(self, seqs, positions, widths)

    monkeypatch.setattr(ModelRunner, "set_selections", checked_selections)
    llm, outs = run(tiny_qwen3[0], prompts, method=method, stride=4, min_budget=8, budget_ratio=0.1,
                    batch_policy="balanced", async_verify=async_verify, kv_blocks=12, block_size=16, max_batch=5,
                    prefill_chunk=32)
    assert [o.token_ids for o in outs] == plain_greedy
    assert llm.last_stats.offloads > 0 and checked and all(checked)


def test_sparse_drafts_really_differ_from_dense(tiny_qwen3, prompts):
    """With a small budget the sparse drafter must sometimes be wrong: proof the drafts really are sparse."""
    llm, _ = run(tiny_qwen3[0], prompts, method="streaming", stride=4, min_budget=4, budget_ratio=0.01)
    assert sum(llm.last_stats.accepted_counts) < sum(llm.last_stats.drafts_offered)


def test_balanced_staggers_verifications_and_naive_locks_step(tiny_qwen3):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (8,), generator=g).tolist() for _ in range(10)]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    k = 4
    for policy in ("naive", "balanced"):
        llm, _ = run(tiny_qwen3[0], prompts, params, method="pillar", stride=k, min_budget=8, batch_policy=policy,
                     prefill_chunk=1024)
        verifies = llm.last_stats.verifications_per_step
        steady = verifies[k + 2: len(verifies) // 2]            # after the first cycle, before anyone finishes
        if policy == "naive":
            assert set(steady) == {0, len(prompts)}
        else:
            target = len(prompts) / (k + 1)
            assert all(abs(v - target) <= 1 for v in steady), steady


def verifications_per_step(llm, prompts, params) -> list[tuple[int, int, int]]:
    """Run `llm`; for every step with drafting requests: (step, their verifications, drafting requests). (A request
    that decodes plainly near the end verifies every step and holds no verify slot.)"""
    from nano_sparsespec.scheduler import Status

    steps = []

    def on_step(event):
        drafting = sum(s.status == Status.RUNNING and not s.decodes_plainly for s in event.running)
        if drafting:
            steps.append((event.step, sum(w.kind == "verify" and not w.seq.decodes_plainly for w in event.works),
                          drafting))

    llm.generate(None, params, prompt_token_ids=prompts, on_step=on_step)
    return steps


@pytest.mark.parametrize("async_verify,draft_ahead", [(False, True), (True, False), (True, True)])
def test_balanced_verifies_about_b_over_p_requests_every_step(tiny_qwen3, async_verify, draft_ahead):
    """Balanced batching: with B requests decoding and P steps per cycle (k drafts, the
    verification and, delayed without drafts ahead, the stall), every step verifies floor(B / P) or ceil(B / P) of
    them, so within one of B / P. 12 requests start together (with delayed verification the slot
    of the step their prefill's result is processed on takes a wait to reach); then 30 with
    different prompt and output lengths pass through 12 rows, arriving and finishing at different
    times."""
    g = torch.Generator().manual_seed(2)
    k = 4
    options = dict(method="pillar", stride=k, min_budget=8, batch_policy="balanced",
                   async_verify=async_verify, draft_ahead=draft_ahead, device="cpu", dtype="float32", max_batch=12)
    together = [torch.randint(0, 250, (8,), generator=g).tolist() for _ in range(12)]
    apart = [torch.randint(0, 250, (int(n),), generator=g).tolist()
             for n in torch.randint(3, 40, (30,), generator=g)]
    apart_params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True)
                    for n in torch.randint(20, 90, (30,), generator=g)]
    runs = [(LLM(str(tiny_qwen3[0]), prefill_chunk=1024, **options), together,
             SamplingParams(max_new_tokens=60, ignore_eos=True)),
            (LLM(str(tiny_qwen3[0]), prefill_chunk=64, **options), apart, apart_params)]
    period = k + 1 + (async_verify and not draft_ahead)
    for llm, prompts, params in runs:
        steps = verifications_per_step(llm, prompts, params)
        assert len(steps) > 100
        off = [(step, v, round(b / period, 2)) for step, v, b in steps
               if not b // period <= v <= -(-b // period)]
        assert not off, f"(step, verifications, B / P) not floor or ceil of B / P: {off[:12]}"


@pytest.mark.parametrize("method,cuda_graphs", [("pillar-lookup", False), ("pillar-lookup", True),
                                                ("streaming", False)])
def test_drafting_ahead_removes_the_stall(tiny_qwen3, method, cuda_graphs):
    """Delayed verification with drafts ahead: on the step after its verification a request drafts ahead of the result
    (on the device's accepted count) instead of sitting the step out; it stalls only where a draft could pass its
    last token (every draft in flight accepted). Greedy output equals plain decoding's, eager and padded, and the run
    takes fewer steps than with the stall."""
    from nano_sparsespec.scheduler import Status

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (12,), generator=g)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in torch.randint(30, 80, (12,), generator=g)]
    options = dict(device="cpu", dtype="float32", block_size=16, max_batch=12, prefill_chunk=64)
    plain = [o.token_ids for o in LLM(str(tiny_qwen3[0]), method="plain", **options).generate(
        None, params, prompt_token_ids=prompts)]
    k, steps = 4, {}
    for draft_ahead in (True, False):
        stalls, aheads = [], 0

        def on_step(event):
            nonlocal aheads
            scheduled = {id(w.seq) for w in event.works}
            aheads += sum(w.ahead for w in event.works)
            stalls.extend((s.params.max_new_tokens - s.num_output, s.num_drafts) for s in event.running
                          if s.status == Status.RUNNING and s.awaiting_result and id(s) not in scheduled)
        llm = LLM(str(tiny_qwen3[0]), method=method, stride=k, min_budget=8, budget_ratio=0.1, async_verify=True,
                  draft_ahead=draft_ahead, plain_tail=0.0, cuda_graphs=cuda_graphs, **options)
        outs = llm.generate(None, params, prompt_token_ids=prompts, on_step=on_step)
        assert [o.token_ids for o in outs] == plain
        steps[draft_ahead] = llm.last_stats.steps
        if draft_ahead:   # (tokens left, drafts in flight): all accepted, one more draft would pass the last token
            assert aheads > 50 and all(left - (drafts + 1) < 2 for left, drafts in stalls), stalls
        else:
            assert aheads == 0 and len(stalls) > 50
    assert steps[True] < steps[False], steps


def test_every_request_finishes_with_tiny_pool(tiny_qwen3, prompts, plain_greedy):
    """A pool that holds about one request at a time: everyone still finishes, nothing is lost or corrupted."""
    llm, outs = run(tiny_qwen3[0], prompts, method="pillar", stride=4, min_budget=8, kv_blocks=8, block_size=16,
                    max_batch=8)
    assert [o.token_ids for o in outs] == plain_greedy


def test_pool_too_small_for_one_request_is_a_clear_error(tiny_qwen3, prompts):
    _, outs = run(tiny_qwen3[0], prompts, method="pillar", kv_blocks=2, block_size=16)
    assert all(o.finish_reason == "error" and "KV pool too small" in o.error for o in outs if o.num_prompt_tokens)
    assert all(o.token_ids == [] for o in outs)


def test_bad_requests_do_not_lose_the_others(tiny_qwen3, prompts, plain_greedy):
    too_long = [i % 250 for i in range(600)]                          # the tiny model's context is 512
    batch = [prompts[0], [], too_long, prompts[1]]
    _, outs = run(tiny_qwen3[0], batch, method="pillar", stride=4, min_budget=8)
    assert outs[0].token_ids == plain_greedy[0] and outs[3].token_ids == plain_greedy[1]
    assert outs[1].finish_reason == "error" and "empty prompt" in outs[1].error
    assert outs[2].finish_reason == "error" and "600 tokens" in outs[2].error and "512" in outs[2].error


def test_context_end_stops_generation(tiny_qwen3):
    _, outs = run(tiny_qwen3[0], [[i % 250 for i in range(500)]], SamplingParams(max_new_tokens=100, ignore_eos=True),
                  method="pillar", stride=4, min_budget=8)
    assert outs[0].finish_reason == "length" and outs[0].num_prompt_tokens + len(outs[0].token_ids) == 512


def test_eos_stops_and_is_kept(tiny_qwen3, prompts, plain_greedy):
    eos = plain_greedy[2][10]                             # pretend this token is EOS
    llm = LLM(str(tiny_qwen3[0]), method="pillar", stride=4, min_budget=8)
    llm.eos_token_ids = {eos}
    out = llm.generate(None, SamplingParams(max_new_tokens=40), prompt_token_ids=[prompts[2]])[0]
    first = plain_greedy[2].index(eos)
    assert out.finish_reason == "stop" and out.token_ids == plain_greedy[2][:first + 1]


@pytest.mark.parametrize("kv_blocks", [None, 8])
def test_plain_running_ahead_commits_what_sync_plain_commits(tiny_qwen3, prompts, kv_blocks):
    """Overlapped plain decoding (async_verify: step t+1 is launched on the token step t sampled, still on the device)
    writes exactly what synchronous plain decoding writes: greedy and sampled rows, requests stopping at EOS, at
    their length or after one token, more requests than rows, and (kv_blocks=8) a pool that offloads. A request that
    stopped at EOS had already launched one more step: that step's token is computed and dropped."""
    params = [SamplingParams(max_new_tokens=(40, 1, 2, 25)[i % 4], temperature=(0.0, 0.8)[i % 2], seed=i)
              for i in range(len(prompts))]
    outputs, stats = [], []
    for async_verify in (False, True):
        llm = LLM(str(tiny_qwen3[0]), method="plain", async_verify=async_verify, max_batch=5, block_size=16,
                  kv_blocks=kv_blocks)
        llm.eos_token_ids = {34}          # a token this model writes often, so some requests stop at it
        outputs.append([(o.token_ids, o.finish_reason) for o in llm.generate(None, params, prompt_token_ids=prompts)])
        stats.append(llm.last_stats)
    assert outputs[1] == outputs[0]
    reasons = [r for _, r in outputs[0]]
    assert "stop" in reasons and "length" in reasons
    ran_past_eos = sum(r == "stop" and 1 < len(t) < p.max_new_tokens for (t, r), p in zip(outputs[0], params))
    assert sum(stats[1].tokens_per_step) - sum(stats[0].tokens_per_step) == ran_past_eos > 0
    if kv_blocks is not None:
        assert stats[1].offloads > 0


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(stride=0), "stride"), (dict(budget_ratio=0.0), "budget_ratio"), (dict(budget_ratio=1.5), "budget_ratio"),
    (dict(min_budget=0), "min_budget"), (dict(method="medusa"), "medusa"), (dict(batch_policy="fifo"), "fifo"),
    (dict(plain_tail=1.0), "plain_tail"), (dict(plain_tail=-0.5), "plain_tail"), (dict(score_every=0), "score_every"),
    (dict(refresh_every=0), "refresh_every")])
def test_bad_spec_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**bad)


def test_a_step_part_without_scores_reads_as_zeros():
    """`joined_results`: the parts of a step (its prefill chunks run apart on the fast path) join their packed results
    and scores; a part whose verifications keep their selections has none and reads as zeros, so the other part's
    last prefill chunks still get theirs."""
    scored = torch.arange(2 * 1 * 3 * 4, dtype=torch.float32).view(2, 1, 3, 4)           # [Ls, Bv, n_kv, L]
    packed, scores = joined_results([torch.ones(2, 5, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)],
                                    [None, scored], "cpu")
    assert packed.shape == (3, 5) and scores.shape == (2, 3, 3, 4)
    assert torch.equal(scores[:, :2], torch.zeros(2, 2, 3, 4)) and torch.equal(scores[:, 2:], scored)
    assert joined_results([torch.ones(1, 3, dtype=torch.long)] * 2, [None, None], "cpu")[1] is None


def chi_square_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for 'two samples of categories come from one distribution'."""
    cats = np.union1d(a, b)
    ca = np.array([(a == c).sum() for c in cats], float)
    cb = np.array([(b == c).sum() for c in cats], float)
    keep = (ca + cb) >= 10                                 # pool rare categories into one bin
    ca = np.append(ca[keep], ca[~keep].sum())
    cb = np.append(cb[keep], cb[~keep].sum())
    ka, kb = np.sqrt(cb.sum() / ca.sum()), np.sqrt(ca.sum() / cb.sum())
    nz = (ca + cb) > 0
    stat = (((ka * ca - kb * cb) ** 2) / (ca + cb))[nz].sum()
    return stat, int(nz.sum()) - 1


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value at alpha = 1e-3 (z = 3.09) by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("method,async_verify", [("pillar", False), ("streaming", False), ("ngram", False),
                                                 ("pillar-lookup", True)])
def test_speculative_sampling_matches_plain_sampling(tiny_qwen3, method, async_verify):
    """Distribution of the first generated tokens: speculative sampling vs plain sampling (alpha = 1e-3). With delayed
    verification, the tokens of the second cycle too, whose first draft was sampled ahead of the first's result."""
    n, tokens = 1500, 8 if async_verify else 4
    prompt = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [SamplingParams(temperature=1.5, top_k=20, max_new_tokens=tokens, ignore_eos=True, seed=s)
              for s in range(n)]
    params_b = [SamplingParams(temperature=1.5, top_k=20, max_new_tokens=tokens, ignore_eos=True, seed=10 ** 6 + s)
                for s in range(n)]
    _, plain = run(tiny_qwen3[0], [prompt] * n, params, method="plain", max_batch=n)
    llm, aheads = LLM(str(tiny_qwen3[0]), method=method, stride=3, min_budget=4, budget_ratio=0.01, max_batch=n,
                      async_verify=async_verify), []
    spec = llm.generate(None, params_b, prompt_token_ids=[prompt] * n,
                        on_step=lambda event: aheads.extend(w.seq for w in event.works if w.ahead))
    assert sum(llm.last_stats.drafts_offered) > 0 and (len(aheads) > n) == async_verify
    for position in range(1, tokens):   # the first token comes from the prefill; later ones from verification
        a = np.array([o.token_ids[position] for o in plain])
        b = np.array([o.token_ids[position] for o in spec])
        stat, df = chi_square_two_sample(a, b)
        assert stat < chi_square_critical(df), (position, stat, df)


def test_device_block_tables_follow_the_host_tables(tiny_qwen3):
    """ModelRunner mirrors block tables on the device and sends only what changed: after growth, rollbacks that free
    blocks, an offload + restore into other blocks and a row taken over by another request, the device rows read back
    equal the host tables, and hold the scratch block past them (no stale block of the row's earlier tables)."""
    from nano_sparsespec.kv_cache import KVCache
    from nano_sparsespec.model import load_model
    from nano_sparsespec.runner import ModelRunner
    from nano_sparsespec.scheduler import Sequence

    model = load_model(str(tiny_qwen3[0]), torch.device("cpu"), torch.float32)
    cfg = model.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, 4, torch.float32, "cpu", host_blocks=40)
    runner = ModelRunner(model, cache, SpecConfig(method="pillar", max_batch=3))
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(), i) for i in range(3)]
    for row, seq in enumerate(seqs):
        seq.row = row

    def check():
        live = [s for s in seqs if s.seq_id in cache.pool.tables]
        changes = runner.step_lists.table_changes(live)
        runner._apply_table_changes(torch.tensor(changes) if changes else None,
                                    max(len(cache.pool.tables[s.seq_id]) for s in live))
        tables = runner.block_tables[[s.row for s in live]]
        for s, row in zip(live, tables.tolist()):
            table = cache.pool.tables[s.seq_id]
            assert row[:len(table)] == table, s.seq_id
            assert row[len(table):] == [cache.scratch_block] * (len(row) - len(table)), s.seq_id

    for n in (5, 9, 2):
        for s in seqs:
            cache.append(s.seq_id, n)
        check()
    cache.rollback(seqs[0].seq_id, 9)                 # frees blocks at the end of the table
    cache.append(seqs[1].seq_id, 3)
    cache.append(seqs[0].seq_id, 6)                   # regrows into blocks freed by others
    check()
    cache.offload(seqs[2].seq_id)
    cache.append(seqs[1].seq_id, 8)                   # takes blocks the offloaded request gave back
    cache.restore(seqs[2].seq_id)                     # same request, other blocks
    check()
    cache.free(seqs[1].seq_id)
    seqs[1] = Sequence(7, [4, 5], SamplingParams(), 7)
    seqs[1].row = 1                                   # a new request in the freed row, with a shorter table
    cache.append(7, 3)
    check()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fetch_returns_the_step_results_and_waits_for_that_step_only(device):
    """`StepResult.fetch` hands the host one step's results (one packed copy, queued by `start_copy` at the end of
    `launch`). On CUDA it must not wait for work queued after that copy: with delayed verification that work is the
    next step, which the host's processing of this one is meant to overlap. Here the next step is a GPU spin of about
    a second, still running when the fetch returns."""
    dev = torch.device(device)
    result = StepResult([], [], [2, 1], torch.tensor([[2, 7, 0, 3, 4], [0, 9, 1, 5, 0]], device=dev))
    result.start_copy()
    if dev.type == "cuda":
        torch.cuda._sleep(2 ** 31)                           # queued behind the copy
    got = result.fetch()
    if dev.type == "cuda":
        assert not torch.cuda.current_stream().query()        # the "next step" is still running
        torch.cuda.synchronize()
    assert got == {"num_accepted": [2, 0], "next_token": [7, 9], "is_bonus": [False, True],
                   "draft_tokens": [[3, 4], [5, 0]]}


@pytest.mark.parametrize("phase", ["schedule", "launch", "queue", "process"])
def test_host_time_is_counted_in_the_phase_that_spends_it(tiny_qwen3, prompts, monkeypatch, phase):
    """`RunStats` splits the loop's wall time by phase: 30 ms added to one phase's every call shows up there alone
    (queuing a step's device work is part of launching it, a new selection part of processing a result), and the
    phases (waiting for results inside `process`) fit in the run's seconds. The loop reads a clock that only the
    added delay moves, so the machine's load cannot leak into another phase."""
    import types

    from nano_sparsespec import async_loop, runner
    from nano_sparsespec.async_loop import Engine
    from nano_sparsespec.runner import ModelRunner
    from nano_sparsespec.scheduler import Scheduler

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(async_loop, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    owner, name, shows_in = {"schedule": (Scheduler, "schedule", {"schedule"}),
                             "launch": (ModelRunner, "launch", {"launch"}),
                             "queue": (ModelRunner, "_compute", {"launch", "queue"}),
                             "process": (Engine, "_refresh_drafting_state", {"process", "selections"})}[phase]
    original = getattr(owner, name)

    def slowed(*args, **kwargs):
        now[0] += 0.03
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slowed)
    llm, _ = run(tiny_qwen3[0], prompts[:2], method="pillar", stride=4, async_verify=True, batch_policy="balanced")
    stats = llm.last_stats
    spent = {"schedule": stats.schedule_seconds, "launch": stats.launch_seconds, "queue": stats.queue_seconds,
             "process": stats.process_seconds, "selections": stats.selection_seconds}
    calls = stats.steps             # each launched step is scheduled, launched and processed once
    assert all(spent[where] >= 0.03 * calls - 1e-9 > 0 for where in shows_in)
    assert all(seconds == 0 for other, seconds in spent.items() if other not in shows_in)
    assert stats.schedule_seconds + stats.launch_seconds + stats.process_seconds <= stats.seconds
    assert stats.result_wait_seconds <= stats.process_seconds


def test_run_sets_the_collector_aside_and_restores_it(tiny_qwen3, prompts):
    """During a run the objects alive before it are frozen out of the collector's full passes; after it (or after
    an error inside it) the collector counts them again, as it did before; a caller's own frozen objects stay frozen."""
    import gc

    llm, before = LLM(str(tiny_qwen3[0]), device="cpu", dtype="float32", method="pillar"), gc.get_freeze_count()
    during = []
    llm.generate(None, GREEDY, prompt_token_ids=prompts[:2], on_step=lambda event: during.append(gc.get_freeze_count()))
    assert min(during) > before and gc.get_freeze_count() == before

    def fail(event):
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"):
        llm.generate(None, GREEDY, prompt_token_ids=prompts[:2], on_step=fail)
    assert gc.get_freeze_count() == before
    gc.freeze()                     # a caller that froze its own objects: the run leaves them frozen
    try:
        llm.generate(None, GREEDY, prompt_token_ids=prompts[:2])
        assert gc.get_freeze_count() > 0         # (freed frozen objects leave the count: not ==)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_call_frees_its_kv_pool_when_it_returns(tiny_qwen3, prompts, monkeypatch, cuda_graphs):
    """Two pools that each fit the device alone must not need to fit together: once a call returns, nothing refers
    to its engine and no reference cycle keeps its runner or KV pool alive (the collector off, as a big allocation
    does not trigger it)."""
    import gc
    import weakref

    from nano_sparsespec import llm as llm_module
    from nano_sparsespec.kv_cache import KVCache

    pools = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(weakref.ref(self))

    monkeypatch.setattr(llm_module, "KVCache", Recorded)
    llm = LLM(str(tiny_qwen3[0]), device="cpu", dtype="float32", method="pillar-lookup", cuda_graphs=cuda_graphs)
    gc.disable()
    try:
        for _ in range(2):
            llm.generate(None, GREEDY, prompt_token_ids=prompts[:2])
            assert pools[-1]() is None, "the call's KV pool is still held"
    finally:
        gc.enable()
    assert len(pools) == 2
