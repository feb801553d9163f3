"""Checkers of the exercises: each runs a student's function against the package's own implementation.

`CHECKS[n](module)` raises AssertionError (with a message that says what went wrong) unless `module`'s functions
agree with nano_sparsespec on hand-made and random cases; it prints one line per passed check. `module` is the
student's file, the reference solution, or anything with the same attribute names (the tests plant wrong ones).
"""
from __future__ import annotations

import torch

from nano_sparsespec import SamplingParams, SpecConfig, attention, pillar_attn, verifier
from nano_sparsespec.kv_cache import KVCache
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
        assert int(got[0]) == n, f"case {case}: num_accepted {int(got[0])}, the package accepts {n} " \
                                 f"(accept draft j while u_accept[j] * q[j, x_j] < p[j, x_j])"
        assert int(got[1]) == token, f"case {case}: token {int(got[1])}, the package emits {token} after " \
                                     f"{n} accepted ({'bonus from p[K]' if n == K else 'residual max(0, p - q)'})"
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
        _, s = attention.dense_attention(q, k, v, mask, row_weight[None])  # s: [1, n_kv, N]
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
        assert bool((got < context_len).all()), f"case {case}: chose a position >= context_len={context_len}"
        same = got.sort(-1).values == ref.sort(-1).values
        assert bool(same.all()), f"case {case} ({H} query heads, {n_kv} KV heads, context {context_len}, budget " \
                                 f"{budget}): the chosen positions differ from pillar_attn.select_pillar in " \
                                 f"{int((~same.all(-1)).sum())} of {same.shape[0] * same.shape[1]} (layer, KV head)s"
    passed("4 cases (GQA groups of 3, 3 and 4, MHA; rejected-draft columns that attract attention; budget > "
           "context) select what dense_attention's scores + select_pillar select")


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
            ref = tiny_scheduler(method="pillar", stride=k, async_verify=async_verify).period
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
        sched = tiny_scheduler(method="pillar", stride=4, async_verify=async_verify)
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

def full_pool_scenario(g):
    """A scheduler whose running requests all hold full KV blocks, with fewer free blocks than the next step needs
    (every scheduled request needs one more), so `schedule` must offload someone.
    Returns (scheduler, [(sequence, awaiting_result, scheduled)])."""
    block = 4
    while True:
        n = int(torch.randint(1, 7, (1,), generator=g))
        prefilling = (torch.rand(n, generator=g) < 0.3).tolist()
        awaiting = [not pre and bool(torch.rand(1, generator=g) < 0.3) for pre in prefilling]
        # scheduled: decoding requests not awaiting a result, and the first prefilling one (the chunk budget is 1 block)
        first_prefill = prefilling.index(True) if True in prefilling else None
        scheduled = [i == first_prefill if pre else not wait for i, (pre, wait) in enumerate(zip(prefilling, awaiting))]
        if any(scheduled):
            break
    held = n                                   # blocks each request holds: one victim frees enough for the step
    free = int(torch.randint(0, sum(scheduled), (1,), generator=g))
    spec = SpecConfig(method="pillar", stride=3, batch_policy="naive", async_verify=True, block_size=block,
                      prefill_chunk=block, max_batch=16)
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=n * held + free, block_size=block,
                    dtype=torch.float32, device="cpu", host_blocks=8 * n * held)
    sched = Scheduler(spec, cache, max_len=4096)
    admitted = torch.randperm(n, generator=g).tolist()
    for i in range(n):
        if prefilling[i]:   # a prompt of held + 1 blocks, `held` of them cached
            seq = Sequence(i, [1] * (block * (held + 1)), SamplingParams(max_new_tokens=100), seed=0)
            seq.status, seq.num_prefilled = Status.PREFILL, block * held
        else:               # decoding: verified context + drafts fill `held` blocks; its next token needs one more
            drafts = int(torch.randint(0, 3, (1,), generator=g))
            seq = Sequence(i, [1] * 3, SamplingParams(max_new_tokens=100), seed=0)
            seq.tokens += [1] * (block * held - 3 - drafts + 1)              # num_verified = len(tokens) - 1
            seq.status, seq.num_prefilled, seq.num_drafts = Status.RUNNING, 3, drafts
            seq.results_in_flight = int(awaiting[i])
        seq.admitted_at, seq.row = admitted[i], i
        cache.append(i, block * held)
        sched.running.append(seq)
    return sched, list(zip(sched.running, awaiting, scheduled))


def check_5(m) -> None:
    from tutorials.exercises.ex5_offload_victim import Candidate

    g = torch.Generator().manual_seed(5)
    seen = {"victim": 0, "none": 0}
    for case in range(300):
        sched, cands = full_pool_scenario(g)
        running = [Candidate(s.seq_id, s.admitted_at, awaiting, scheduled) for s, awaiting, scheduled in cands]
        try:
            sched.schedule(step=1)
            ref = sched.offloaded[0].seq_id if sched.offloaded else None
        except RuntimeError:                  # the scheduler found nobody it may offload
            ref = None
        got = m.pick_victim(list(running))
        assert got == ref, f"case {case}: pick_victim({running}) = {got}, the scheduler offloads " \
                           f"{'nobody' if ref is None else f'request {ref}'}"
        seen["none" if ref is None else "victim"] += 1
    passed(f"300 full-pool scenarios ({seen['victim']} with a victim, {seen['none']} with none possible): the same "
           f"choice as Scheduler.schedule")


CHECKS = {1: check_1, 2: check_2, 3: check_3, 4: check_4, 5: check_5}
