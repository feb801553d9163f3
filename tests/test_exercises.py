"""The exercise checkers, proven right both ways: each passes its reference solution and fails the stub and every
planted wrong implementation written below (each one a mistake a student could plausibly make)."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `tutorials` is a folder of the checkout, not part of the installed package

from tutorials.check import exercise_module, main  # noqa: E402
from tutorials.exercises.checkers import CHECKS  # noqa: E402
from tutorials.exercises.ex5_offload_victim import Candidate  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------------
# planted wrong implementations, one namespace per mistake

def _greedy(count_all=False, ignore_num_drafts=False, bonus_from_last_row=False):
    def accept_greedy(target_probs, draft_tokens, num_drafts):
        K = draft_tokens.shape[1]
        target = target_probs.argmax(-1)
        match = draft_tokens == target[:, :K]
        if not ignore_num_drafts:
            match &= torch.arange(K) < num_drafts[:, None]
        n = match.long().sum(-1) if count_all else match.long().cumprod(-1).sum(-1)
        row = torch.full_like(n, K) if bonus_from_last_row else n
        return n, target.gather(1, row[:, None]).squeeze(1)
    return types.SimpleNamespace(accept_greedy=accept_greedy)


def _rejection(residual_is_p=False, inverted_test=False):
    def verify_one(p, q, draft, u_accept, u_next):
        K, n = draft.shape[0], 0
        while n < K:
            px, qx = p[n, draft[n]], q[n, draft[n]]
            if not (u_accept[n] * px < qx if inverted_test else u_accept[n] * qx < px):
                break
            n += 1
        dist = p[n] if n == K or residual_is_p else (p[n] - q[n]).clamp_min(0)
        cdf = dist.cumsum(0)
        return n, min(int(torch.searchsorted(cdf, u_next * cdf[-1], right=True)), dist.shape[0] - 1)
    return types.SimpleNamespace(verify_one=verify_one)


def _critical(strided_groups=False, ignore_context=False, unweighted_rows=False):
    def select_critical(probs, num_kv_heads, row_weight, context_len, budget):
        L, H, Q, N = probs.shape
        weight = torch.full_like(row_weight, 1 / Q) if unweighted_rows else row_weight
        per_head = torch.einsum("lhqn,q->lhn", probs, weight)
        if strided_groups:           # head h in group h % n_kv instead of h // G
            scores = per_head.view(L, H // num_kv_heads, num_kv_heads, N).mean(1)
        else:
            scores = per_head.view(L, num_kv_heads, H // num_kv_heads, N).mean(2)
        if not ignore_context:
            scores = scores[..., :context_len]
        return scores.topk(min(budget, context_len), dim=-1).indices
    return types.SimpleNamespace(select_critical=select_critical)


def _phases(round_robin=False, ignore_stall=False, no_stall_step=False):
    solution, _ = exercise_module(4, solution=True)

    def period(stride, async_verify):
        return stride + 1 if no_stall_step else solution.period(stride, async_verify)

    def choose_slot(live_slots, period):
        return len(live_slots) % period if round_robin else solution.choose_slot(live_slots, period)

    def action(step, slot, period, awaiting_result):
        return solution.action(step, slot, period, False if ignore_stall else awaiting_result)
    return types.SimpleNamespace(period=period, choose_slot=choose_slot, action=action)


def _victim(oldest=False, ignore_scheduled=False, no_last_guard=False, ignore_awaiting=False):
    def pick_victim(running: list[Candidate]):
        if not no_last_guard and (len(running) <= 1 or sum(c.scheduled for c in running) <= 1):
            return None
        movable = [c for c in running if (c.scheduled or ignore_scheduled)
                   and (ignore_awaiting or not c.awaiting_result)]
        if not movable:
            return None
        pick = min if oldest else max
        return pick(movable, key=lambda c: c.admitted_at).seq_id
    return types.SimpleNamespace(pick_victim=pick_victim)


def _sparse(one_head_per_group=False, modulo_groups=False, softmax_over_all=False, no_scale=False):
    def attend_selected(q, k, v, selected):
        (H, D), n_kv = q.shape, k.shape[1]
        G = H // n_kv
        out = torch.empty_like(q)
        for h in range(H):
            kv = h % n_kv if modulo_groups else h // G
            query = q[kv * G] if one_head_per_group else q[h]           # the group's first head stands for all
            logits = k[:, kv] @ query * (1.0 if no_scale else D ** -0.5)              # [L]
            if softmax_over_all:     # normalised over the whole context, then only the selected values mixed
                out[h] = logits.softmax(0)[selected[kv]] @ v[selected[kv], kv]
            else:
                out[h] = logits[selected[kv]].softmax(0) @ v[selected[kv], kv]
        return out
    return types.SimpleNamespace(attend_selected=attend_selected)


def _rollback(keep_extra=False, free_partial=False, keep_emptied=False, no_validation=False):
    def rollback(block_table, length, block_size, n_rejected):
        if not no_validation and not 0 <= n_rejected <= length:
            raise ValueError("impossible count")
        new_length = max(0, min(length, length - n_rejected))
        if keep_extra:               # off by one: one block more than the positions need
            keep = min(len(block_table), new_length // block_size + 1)
        elif free_partial:           # rounds down: a partly filled last block is freed too
            keep = new_length // block_size
        elif keep_emptied:           # only the length changes
            keep = len(block_table)
        else:
            keep = -(-new_length // block_size)
        return new_length, block_table[:keep], block_table[keep:]
    return types.SimpleNamespace(rollback=rollback)


PLANTED = {
    1: [_greedy(count_all=True), _greedy(ignore_num_drafts=True), _greedy(bonus_from_last_row=True)],
    2: [_rejection(residual_is_p=True), _rejection(inverted_test=True)],
    3: [_critical(strided_groups=True), _critical(ignore_context=True), _critical(unweighted_rows=True)],
    4: [_phases(round_robin=True), _phases(ignore_stall=True), _phases(no_stall_step=True)],
    5: [_victim(oldest=True), _victim(ignore_scheduled=True), _victim(no_last_guard=True),
        _victim(ignore_awaiting=True)],
    6: [_sparse(one_head_per_group=True), _sparse(modulo_groups=True), _sparse(softmax_over_all=True),
        _sparse(no_scale=True)],
    7: [_rollback(keep_extra=True), _rollback(free_partial=True), _rollback(keep_emptied=True),
        _rollback(no_validation=True)],
}


@pytest.mark.parametrize("n", sorted(CHECKS))
def test_checker_passes_the_reference_solution(n):
    module, _ = exercise_module(n, solution=True)
    CHECKS[n](module)


@pytest.mark.parametrize("n,wrong", [(n, i) for n, planted in PLANTED.items() for i in range(len(planted))])
def test_checker_fails_a_planted_wrong_solution(n, wrong):
    with pytest.raises(AssertionError):
        CHECKS[n](PLANTED[n][wrong])


def test_every_exercise_has_a_planted_wrong_solution():
    assert sorted(PLANTED) == sorted(CHECKS) and len(CHECKS) >= 7


@pytest.mark.parametrize("n", sorted(CHECKS))
def test_checker_fails_the_stub(n):
    """A function that raises NotImplementedError (what every exercise file ships with) never passes."""
    solution, _ = exercise_module(n, solution=True)

    def stub(*args, **kwargs):
        raise NotImplementedError(f"exercise {n}: not written")
    names = [name for name, value in vars(solution).items()
             if callable(value) and getattr(value, "__module__", None) == solution.__name__]
    with pytest.raises(NotImplementedError):
        CHECKS[n](types.SimpleNamespace(**{name: stub for name in names}))


@pytest.mark.parametrize("n", sorted(CHECKS))
def test_student_file_is_the_stub_or_correct(n, capsys):
    """The student's file ships as a stub whose functions raise NotImplementedError (`check N` then exits 1, saying
    so); once written, it must pass."""
    module, _ = exercise_module(n, solution=False)
    try:
        CHECKS[n](module)
    except NotImplementedError as e:
        assert f"exercise {n}" in str(e)
        capsys.readouterr()
        assert main([str(n)]) == 1 and "not written yet" in capsys.readouterr().out


def test_check_command():
    ok = subprocess.run([sys.executable, "-m", "tutorials.check", "1", "--solution"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "all checks passed" in ok.stdout, ok.stdout + ok.stderr
    stub = subprocess.run([sys.executable, "-m", "tutorials.check", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert stub.returncode == 1 and "not written yet" in stub.stdout, stub.stdout + stub.stderr


# ----------------------------------------------------------------------------------------------------------------------
# what the failures say

def test_exercise_3_failure_names_the_layer_head_and_positions():
    with pytest.raises(AssertionError, match=r"layer \d+, KV head \d+.*positions"):
        CHECKS[3](_critical(strided_groups=True))


def test_exercise_6_failure_names_the_query_head_and_its_kv_head():
    with pytest.raises(AssertionError, match=r"query head \d+ \(of KV head \d+\)"):
        CHECKS[6](_sparse(no_scale=True))


def test_exercise_5_scenarios_schedule_a_request_whose_result_is_in_flight():
    """The runs-ahead scenarios give a request with a result in flight work in the step; the checker fails a policy
    that would offload it (it must stay: processing its result touches its KV)."""
    with pytest.raises(AssertionError, match="in flight"):
        CHECKS[5](_victim(ignore_awaiting=True))
