"""Checkers of the exercises: each runs a student's function against the package's own implementation.

`CHECKS[n](module)` raises AssertionError (with a message that says what went wrong) unless `module`'s functions
agree with nano_sparsespec on hand-made and random cases; it prints one line per passed check. `module` is the
student's file, the reference solution, or anything with the same attribute names (the tests plant wrong ones).
"""
from __future__ import annotations

from collections import deque

import torch

from nano_sparsespec import SamplingParams, SpecConfig, attention, pillar_attn, verifier
from nano_sparsespec.kv_cache import BlockPool, KVCache
from nano_sparsespec.scheduler import Scheduler, Sequence, Status


def passed(what: str) -> None:
    print(f"  ok  {what}")


# ----------------------------------------------------------------------------------------------------------------------
# 1. greedy acceptance

def one_hot_rows(choices: list[list[int]], vocab: int) -> torch.Tensor:
    """[B][K+1] argmax choices -> Float[B, K+1, V] distributions peaked at them (not exactly one-hot)."""
    probs = torch.full((len(choices), len(choices[0]), vocab), 0.5 / vocab)
    probs.scatter_(2, torch.tensor(choices)[..., None], 0.6)
    return probs


def check_1(m) -> None:
    target = one_hot_rows([[2, 4, 1, 3]] * 4, vocab=5)                      # the target's choices: 2, 4, 1, then 3
    drafts = torch.tensor([[2, 4, 0], [2, 4, 1], [0, 4, 1], [2, 4, 1]])
    n, token = m.accept_greedy(target, drafts, torch.tensor([3, 3, 3, 1]))
    assert n.tolist() == [2, 3, 0, 1], f"num_accepted should be [2, 3, 0, 1], got {n.tolist()}"
    assert token.tolist() == [1, 3, 2, 4], \
        f"next_token should be [1, 3, 2, 4] (correction / bonus / correction / padding ignored), got {token.tolist()}"
    passed("hand-made: a mismatch, all accepted (bonus), first draft wrong, padding after num_drafts ignored")

    g = torch.Generator().manual_seed(1)
    B, K, V = 256, 6, 11
    target = torch.rand(B, K + 1, V, generator=g).softmax(-1)
    choice = target.argmax(-1)                                                # [B, K+1]
    lucky = torch.rand(B, K, generator=g) < 0.8                               # drafts right 80% of the time
    drafts = torch.where(lucky, choice[:, :K], torch.randint(0, V, (B, K), generator=g))
    num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    n, token = m.accept_greedy(target, drafts, num_drafts)
    ref_n, ref_token = verifier.verify_greedy(target, drafts, num_drafts)
    assert n.shape == (B,) and token.shape == (B,), f"expected shapes [{B}] and [{B}], got {n.shape}, {token.shape}"
    assert torch.equal(n.long(), ref_n), f"num_accepted differs from verifier.verify_greedy in " \
                                         f"{int((n.long() != ref_n).sum())} of {B} random requests"
    assert torch.equal(token.long(), ref_token), f"next_token differs from verifier.verify_greedy in " \
                                                 f"{int((token.long() != ref_token).sum())} of {B} random requests"
    passed(f"{B} random requests (0..{K} drafts each) agree with verifier.verify_greedy")


# ----------------------------------------------------------------------------------------------------------------------
# 2. rejection sampling

def check_2(m) -> None:
    g = torch.Generator().manual_seed(2)
    K, V, cases = 4, 6, 300
    p = (3 * torch.randn(cases, K + 1, V, generator=g)).softmax(-1)            # [cases, K+1, V] peaked target rows
    q = 0.5 * p[:, :K] + 0.5 * (3 * torch.randn(cases, K, V, generator=g)).softmax(-1)   # [cases, K, V] drafter
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(cases, K)    # [cases, K] drafts sampled from q
    seed, first = torch.arange(cases), torch.full((cases,), 10)
    ref_n, ref_token = verifier.verify_rejection(p, draft, q, torch.full((cases,), K), seed, first)
    positions = first[:, None] + torch.arange(K)                               # [cases, K]
    u_accept = verifier.uniform(seed[:, None].expand(-1, K), positions, verifier.SALT_ACCEPT)     # [cases, K]
    u_bonus = verifier.uniform(seed, first + ref_n, verifier.SALT_TARGET)      # [cases] the package's u for the bonus
    u_residual = verifier.uniform(seed, first + ref_n, verifier.SALT_RESIDUAL)  # ... and for a recovered token
    for case in range(cases):
        n, token = int(ref_n[case]), int(ref_token[case])
        u_next = float(u_bonus[case] if n == K else u_residual[case])
        got = m.verify_one(p[case], q[case], draft[case], u_accept[case], u_next)
        if int(got[0]) != n:
            j = min(int(got[0]), n)               # the first draft on which you and the package disagree
            x = int(draft[case, j]) if j < K else None
            raise AssertionError(
                f"case {case}: you keep {int(got[0])} of {K} drafts, the package keeps {n}" + (
                    f"; draft {j} (token {x}): target p = {float(p[case, j, x]):.4f}, drafter q = "
                    f"{float(q[case, j, x]):.4f}, u_accept = {float(u_accept[case, j]):.4f}: the package "
                    f"{'keeps' if n > j else 'rejects'} it" if x is not None else ""))
        what = f"the bonus, sampled from p[{K}]" if n == K else f"a replacement, sampled from the residual at draft {n}"
        assert int(got[1]) == token, f"case {case}: after {n} kept drafts you emit token {int(got[1])}, the " \
                                     f"package emits {token}: {what} with u_next = {u_next:.4f}"
    passed(f"{cases} random cases give the same accepted count and token as verifier.verify_rejection")

    # Lossless: whatever q, the first emitted token is distributed as p[0].
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])      # [K+1 = 2, V = 4]
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])                                  # a poor drafter
    trials, counts = 4000, torch.zeros(4)
    drafts = torch.multinomial(q[0], trials, replacement=True, generator=g)
    u = torch.rand(trials, 2, generator=g)
    for x, (ua, un) in zip(drafts, u):
        n, token = m.verify_one(p, q, x[None], ua[None], float(un))
        counts[int(x) if int(n) >= 1 else int(token)] += 1
    tv = 0.5 * (counts / trials - p[0]).abs().sum()
    assert tv < 0.035, f"the first emitted token is not distributed as the target p[0]: {(counts / trials).tolist()} " \
                       f"vs {p[0].tolist()} (total variation {tv:.3f})"
    passed(f"lossless: over {trials} draws the first token follows the target (total variation {tv:.3f})")


# ----------------------------------------------------------------------------------------------------------------------
# 3. critical tokens with GQA averaging

def attention_case(g, L=3, H=6, n_kv=2, Q=4, N=40, context_len=36, hot_tail=True):
    """Random q/k/v for L layers and the package's reference selection inputs.
    Returns (probs [L, H, Q, N], row_weight [Q], reference scores [L, 1, n_kv, N])."""
    D = 8
    probs, scores = [], []
    row_weight = torch.tensor([0.55, 0.25, 0.15, 0.05])[:Q]
    row_weight = row_weight / row_weight.sum()
    for _ in range(L):
        q = torch.randn(1, Q, H, D, generator=g) * 2                          # [1, Q, H, D]
        k = torch.randn(1, N, n_kv, D, generator=g) * 2                       # [1, N, n_kv, D]
        if hot_tail:   # make the columns past context_len attractive: a selection that ignores context_len fails
            k[0, context_len:] = q[0, :, ::H // n_kv].mean(0) * 3
        v = torch.randn(1, N, n_kv, D, generator=g)
        mask = torch.ones(1, Q, N, dtype=torch.bool)
        s = pillar_attn.pillar_scores(q, k, mask, row_weight[None])          # s: [1, n_kv, N]
        scores.append(s)
        G = H // n_kv    # the package orders query heads by KV head: head h = kv * G + g
        logits = torch.einsum("qhd,nhd->hqn", q[0], k[0].repeat_interleave(G, 1)) * D ** -0.5
        probs.append(logits.softmax(-1))                                      # [H, Q, N]
    return torch.stack(probs), row_weight, torch.stack(scores)               # [L, H, Q, N], [Q], [L, 1, n_kv, N]


def check_3(m) -> None:
    g = torch.Generator().manual_seed(3)
    for case, (n_kv, H, context_len, budget) in enumerate([(2, 6, 36, 8), (3, 9, 30, 5), (1, 4, 40, 12),
                                                           (2, 8, 6, 10)]):
        probs, weight, scores = attention_case(g, H=H, n_kv=n_kv, context_len=context_len,
                                               hot_tail=context_len < 40)
        ref = pillar_attn.select_pillar(scores, [context_len], [budget])[0]  # [L, n_kv, min(budget, context_len)]
        got = m.select_critical(probs, n_kv, weight, context_len, budget)
        assert tuple(got.shape) == tuple(ref.shape), f"case {case}: shape {tuple(got.shape)}, expected " \
                                                     f"{tuple(ref.shape)} = [L, n_kv, min(budget, context_len)]"
        if not bool((got < context_len).all()):
            layer, head = (got >= context_len).any(-1).nonzero()[0].tolist()
            raise AssertionError(f"case {case}: at layer {layer}, KV head {head} you chose positions "
                                 f"{sorted(p for p in got[layer, head].tolist() if p >= context_len)}, past the "
                                 f"verified context (positions 0..{context_len - 1}): rejected drafts' columns")
        wrong = [(layer, head) for layer in range(ref.shape[0]) for head in range(ref.shape[1])
                 if set(got[layer, head].tolist()) != set(ref[layer, head].tolist())]
        if wrong:
            layer, head = wrong[0]
            mine, theirs = set(got[layer, head].tolist()), set(ref[layer, head].tolist())
            score = scores[layer, 0, head]                                          # [N] the reference scores
            raise AssertionError(
                f"case {case} ({H} query heads, {n_kv} KV heads, context {context_len}, budget {budget}): at layer "
                f"{layer}, KV head {head} (query heads {head * (H // n_kv)}..{(head + 1) * (H // n_kv) - 1}) you chose "
                f"positions {sorted(mine - theirs)} instead of {sorted(theirs - mine)} "
                f"(their scores: {[round(float(score[i]), 4) for i in sorted(mine - theirs)]} vs "
                f"{[round(float(score[i]), 4) for i in sorted(theirs - mine)]}); {len(wrong)} of "
                f"{ref.shape[0] * ref.shape[1]} (layer, KV head)s differ from pillar_attn.select_pillar")
    passed("4 cases (GQA groups of 3, 3 and 4, MHA; rejected-draft columns that attract attention; budget > "
           "context) select what pillar_scores + select_pillar select")


# ----------------------------------------------------------------------------------------------------------------------
# 4. the balanced phase clock

def tiny_scheduler(**spec) -> Scheduler:
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=64, block_size=4, dtype=torch.float32,
                    device="cpu", host_blocks=64)
    return Scheduler(SpecConfig(**spec), cache, max_len=4096)


def running_sequence(seq_id: int, slot: int = 0) -> Sequence:
    seq = Sequence(seq_id, [1, 2, 3], SamplingParams(max_new_tokens=100), seed=0)
    seq.status, seq.num_prefilled, seq.verify_slot = Status.RUNNING, 3, slot
    return seq


def check_4(m) -> None:
    for k in (1, 4, 8):
        for async_verify in (False, True):
            # (the exercise's delayed verification stalls: no drafts ahead of the result)
            ref = tiny_scheduler(method="pillar", stride=k, async_verify=async_verify, draft_ahead=False).period
            got = m.period(k, async_verify)
            assert got == ref, f"period(stride={k}, async_verify={async_verify}) = {got}, the scheduler uses {ref}"
    passed("period(k, async) matches Scheduler.period")

    g = torch.Generator().manual_seed(4)
    for case in range(200):
        k = int(torch.randint(1, 7, (1,), generator=g))
        sched = tiny_scheduler(method="pillar", stride=k, batch_policy="balanced")
        live = torch.randint(0, k + 1, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        sched.running = [running_sequence(i, s) for i, s in enumerate(live)]
        new = running_sequence(len(live))
        sched.assign_slot(new)
        got = m.choose_slot(list(live), sched.period)
        assert got == new.verify_slot, f"choose_slot({live}, period={sched.period}) = {got}; the balanced " \
                                       f"scheduler picks {new.verify_slot} (least loaded, lowest on a tie)"
    passed("200 random loads: choose_slot picks what Scheduler.assign_slot picks")

    sched = tiny_scheduler(method="pillar", stride=3, batch_policy="balanced")
    for i in range(3 * sched.period):
        seq = running_sequence(i)
        sched.running.append(seq)
        seq.verify_slot = m.choose_slot([s.verify_slot for s in sched.running[:-1]], sched.period)
    load = [sum(s.verify_slot == slot for s in sched.running) for slot in range(sched.period)]
    assert load == [3] * sched.period, f"{3 * sched.period} requests admitted one by one should fill each of the " \
                                       f"{sched.period} slots 3 times, got loads {load}"
    passed(f"admitting {3 * sched.period} requests one by one spreads them evenly over the slots")

    for async_verify in (False, True):
        sched = tiny_scheduler(method="pillar", stride=4, async_verify=async_verify, draft_ahead=False)
        for slot in range(sched.period):
            for awaiting in (False, True):
                seq = running_sequence(0, slot)
                seq.results_in_flight = int(awaiting)
                for step in range(3 * sched.period):
                    got, ref = m.action(step, slot, sched.period, awaiting), sched.action(seq, step)
                    assert got == ref, f"action(step={step}, slot={slot}, period={sched.period}, " \
                                       f"awaiting_result={awaiting}) = {got!r}, the scheduler says {ref!r}"
    passed("action() agrees with Scheduler.action on every step, slot and in-flight state")


# ----------------------------------------------------------------------------------------------------------------------
# 5. the offload victim

def full_pool_scenario(g, runs_ahead: bool):
    """A scheduler whose running requests all hold full KV blocks, with fewer free blocks than the next step needs
    (every scheduled request needs one more), so `schedule` must offload someone.

    runs_ahead False: speculative decoding with delayed verification; a request whose result is in flight stalls, so
    it has no work in the step. runs_ahead True: plain decoding with delayed verification, where such a request runs
    ahead: it has work in the step although its result is still in flight.
    Returns (scheduler, [(sequence, awaiting_result, scheduled)])."""
    block = 4
    while True:
        n = int(torch.randint(1, 7, (1,), generator=g))
        prefilling = (torch.rand(n, generator=g) < 0.3).tolist()
        awaiting = [not pre and bool(torch.rand(1, generator=g) < 0.4) for pre in prefilling]
        # scheduled: the first prefilling request (the chunk budget is one block), and the decoding ones that do not
        # stall (all of them when running ahead)
        first_prefill = prefilling.index(True) if True in prefilling else None
        scheduled = [i == first_prefill if pre else runs_ahead or not wait
                     for i, (pre, wait) in enumerate(zip(prefilling, awaiting))]
        if any(scheduled):
            break
    held = n                                   # blocks each request holds: one victim frees enough for the step
    free = int(torch.randint(0, sum(scheduled), (1,), generator=g))
    spec = SpecConfig(method="plain" if runs_ahead else "pillar", stride=3, batch_policy="naive", async_verify=True,
                      draft_ahead=False, block_size=block, prefill_chunk=block, max_batch=16)
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=n * held + free, block_size=block,
                    dtype=torch.float32, device="cpu", host_blocks=8 * n * held)
    sched = Scheduler(spec, cache, max_len=4096)
    admitted = torch.randperm(n, generator=g).tolist()
    for i in range(n):
        if prefilling[i]:   # a prompt of held + 1 blocks, `held` of them cached
            seq = Sequence(i, [1] * (block * (held + 1)), SamplingParams(max_new_tokens=100), seed=0)
            seq.status, seq.num_prefilled = Status.PREFILL, block * held
        else:               # decoding: its cached positions fill `held` blocks; its next token needs one more
            # cached = verified context + drafts, or + the position whose verification is in flight (running ahead)
            drafts = 0 if runs_ahead else int(torch.randint(0, 3, (1,), generator=g))
            pending = int(runs_ahead and awaiting[i])
            seq = Sequence(i, [1] * 3, SamplingParams(max_new_tokens=100), seed=0)
            seq.tokens += [1] * (block * held - 3 - drafts - pending + 1)      # num_verified = len(tokens) - 1
            seq.status, seq.num_prefilled, seq.num_drafts = Status.RUNNING, 3, drafts
            seq.results_in_flight = int(awaiting[i])
        seq.admitted_at, seq.row = admitted[i], i
        cache.append(i, block * held)
        sched.running.append(seq)
    return sched, list(zip(sched.running, awaiting, scheduled))


def check_5(m) -> None:
    from tutorials.exercises.ex5_offload_victim import Candidate

    g = torch.Generator().manual_seed(5)
    for runs_ahead in (False, True):
        seen = {"victim": 0, "none": 0, "in flight": 0}
        for case in range(200):
            sched, cands = full_pool_scenario(g, runs_ahead)
            running = [Candidate(s.seq_id, s.admitted_at, awaiting, scheduled) for s, awaiting, scheduled in cands]
            try:
                sched.schedule(step=1)
                ref = sched.offloaded[0].seq_id if sched.offloaded else None
            except RuntimeError:                  # the scheduler found nobody it may offload
                ref = None
            got = m.pick_victim(list(running))
            if got != ref:
                by_id = {c.seq_id: c for c in running}
                why = " (it has a result in flight)" if got in by_id and by_id[got].awaiting_result else ""
                raise AssertionError(f"{'plain decoding running ahead' if runs_ahead else 'speculative decoding'}, "
                                     f"case {case}: pick_victim({running}) = {got}{why}, the scheduler offloads "
                                     f"{'nobody' if ref is None else f'request {ref}'}")
            seen["none" if ref is None else "victim"] += 1
            latest = max((c for c in running if c.scheduled), key=lambda c: c.admitted_at)
            seen["in flight"] += latest.awaiting_result and sum(c.scheduled for c in running) > 1
        passed(f"200 full-pool scenarios of {'plain decoding running ahead' if runs_ahead else 'speculative decoding'} "
               f"({seen['victim']} with a victim, {seen['none']} with none possible, {seen['in flight']} where the "
               f"latest admitted request with work has a result in flight): the same choice as Scheduler.schedule")


# ----------------------------------------------------------------------------------------------------------------------
# 6. sparse attention over the selected positions, with GQA

def attend_selected_reference(q, k, v, selected):
    """The package's sparse attention of one token over its selected positions: gather them as
    `attention.fill_draft_buffers` does, then `attention.sparse_attention` with every gathered column valid."""
    heads = torch.arange(k.shape[1])[:, None]                                     # [n_kv, 1]
    keys, values = k[selected, heads], v[selected, heads]                         # [n_kv, B, D]
    valid = torch.ones(selected.shape, dtype=torch.bool)                          # [n_kv, B]
    return attention.sparse_attention(q[None], keys[None], values[None], valid[None])[0]


def compare_heads(got, ref, n_kv, what: str) -> None:
    """Assert got == ref [n_heads, D], naming the first query head (and its KV head) that differs."""
    H = ref.shape[0]
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: output shape {tuple(got.shape)}, expected " \
                                                 f"{tuple(ref.shape)} = [n_heads, D]"
    error = (got.double() - ref.double()).abs().amax(-1)                          # [n_heads]
    wrong = [h for h in range(H) if not bool(error[h] <= 1e-4 + 1e-4 * ref[h].abs().max())]
    if wrong:
        h = wrong[0]
        raise AssertionError(f"{what}: query head {h} (of KV head {h // (H // n_kv)}) is off by up to "
                             f"{float(error[h]):.3g}; query heads that differ: {wrong} of {H}")


def check_6(m) -> None:
    g = torch.Generator().manual_seed(6)
    L, n_kv, H, D = 10, 2, 4, 4
    k, v = torch.randn(L, n_kv, D, generator=g), torch.randn(L, n_kv, D, generator=g)
    selected = torch.tensor([[7, 1, 4], [2, 9, 5]])                                # KV head 0 reads 1, 4, 7; 1: 2, 5, 9
    got = m.attend_selected(torch.zeros(H, D), k, v, selected)
    ref = torch.stack([v[selected[h // 2], h // 2].mean(0) for h in range(H)])
    compare_heads(got, ref, n_kv, "zero queries (every query head attends evenly to its KV head's 3 selected "
                                  "positions, so it outputs the mean of their values)")
    got = m.attend_selected(torch.randn(H, D, generator=g), k, v, selected[:, :1])
    compare_heads(got, v[selected[:, 0], torch.arange(n_kv)].repeat_interleave(2, 0), n_kv,
                  "one selected position per KV head (every query head outputs that position's value)")
    passed("hand-made: zero queries average the selected values of their own KV head; one position gives its value")

    cases = [(8, 2, 16, 50, 7), (6, 3, 8, 30, 5), (4, 1, 32, 40, 10), (4, 4, 8, 20, 4), (12, 4, 64, 100, 16)]
    for case, (H, n_kv, D, L, B) in enumerate(cases):
        q = torch.randn(H, D, generator=g) * 1.5
        k, v = torch.randn(L, n_kv, D, generator=g), torch.randn(L, n_kv, D, generator=g)
        selected = torch.stack([torch.randperm(L, generator=g)[:B] for _ in range(n_kv)])   # [n_kv, B]
        got = m.attend_selected(q.clone(), k.clone(), v.clone(), selected.clone())
        compare_heads(got, attend_selected_reference(q, k, v, selected), n_kv,
                      f"case {case} ({H} query heads, {n_kv} KV heads, head_dim {D}, {B} of {L} positions selected)")
    passed(f"{len(cases)} random cases (GQA groups of 4, 2 and 3, MQA, MHA) agree with attention.sparse_attention "
           f"over the gathered keys and values")


# ----------------------------------------------------------------------------------------------------------------------
# 7. KV rollback after a rejection

def shrink_reference(table: list[int], length: int, block_size: int, n_rejected: int):
    """What BlockPool.shrink does to a pool holding one request in `table`: (new_length, kept, freed) or ValueError."""
    pool = BlockPool(max(table, default=0) + 1, block_size, "device")
    pool.free = deque(b for b in range(pool.num_blocks) if b not in table)
    pool.tables[0], pool.lengths[0] = list(table), length
    before = len(pool.free)
    pool.shrink(0, n_rejected)
    return pool.lengths[0], pool.tables[0], list(pool.free)[before:]


def describe_blocks(table: list[int], length: int, block_size: int) -> str:
    spans = [f"{b}: {i * block_size}..{min(length, (i + 1) * block_size) - 1}" for i, b in enumerate(table)]
    return f"block_size {block_size}, {length} positions in blocks [{', '.join(spans)}]"


def check_rollback(m, table, length, block_size, n_rejected) -> None:
    case = f"{describe_blocks(table, length, block_size)}, {n_rejected} rejected"
    try:
        ref = shrink_reference(table, length, block_size, n_rejected)
    except ValueError:
        try:
            got = m.rollback(list(table), length, block_size, n_rejected)
        except ValueError:
            return
        raise AssertionError(f"{case}: returned {got}; forgetting {n_rejected} of {length} positions is "
                             f"impossible and BlockPool.shrink raises ValueError")
    argument = list(table)
    got = m.rollback(argument, length, block_size, n_rejected)
    assert argument == table, f"{case}: rollback changed its block_table argument to {argument}; return new lists"
    new_length, kept, freed = ref
    assert int(got[0]) == new_length, f"{case}: new length {got[0]}, expected {new_length}"
    assert list(got[1]) == kept and list(got[2]) == freed, \
        f"{case}: kept {list(got[1])} and freed {list(got[2])}; BlockPool.shrink keeps {kept} and frees {freed}" \
        + (f" (block {kept[-1]} still holds position {new_length - 1})" if kept else "")


def check_7(m) -> None:
    table, length = [7, 2, 5], 10                                                  # blocks of 4: 4 + 4 + 2 positions
    for n_rejected in range(0, length + 1):
        check_rollback(m, table, length, 4, n_rejected)
    passed("hand-made: 10 positions in 3 blocks of 4, every rollback from 0 to all 10 (within a block, to a block "
           "boundary, across one and two boundaries, to zero)")
    for n_rejected in (-1, length + 1, length + 5):
        check_rollback(m, table, length, 4, n_rejected)
    check_rollback(m, [], 0, 4, 1)
    passed("invalid counts (negative, more than cached, any from an empty request) raise ValueError")

    g = torch.Generator().manual_seed(7)
    for _ in range(300):
        block_size = int(torch.randint(1, 9, (1,), generator=g))
        length = int(torch.randint(0, 41, (1,), generator=g))
        table = torch.randperm(64, generator=g)[:-(-length // block_size)].tolist()
        n_rejected = int(torch.randint(0, length + 1, (1,), generator=g))
        check_rollback(m, table, length, block_size, n_rejected)
    passed("300 random rollbacks (block sizes 1..8, up to 40 positions) agree with BlockPool.shrink")


CHECKS = {1: check_1, 2: check_2, 3: check_3, 4: check_4, 5: check_5, 6: check_6, 7: check_7}
