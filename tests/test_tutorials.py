"""The tutorials and the exercise checkers.

Every tutorial runs in --quick mode (a subprocess, as a reader runs it) and must exit 0 and print its key line;
tutorial 06's figures (the CLI summary, the benchmark table) are checked too. Every exercise checker is proven right
both ways: it passes the reference solution and fails each planted wrong implementation written below (each one a
mistake a student could plausibly make) and the stub the student's file ships as.
"""
from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `tutorials` is a folder of the checkout, not part of the installed package

from tutorials.check import exercise_module  # noqa: E402
from tutorials.exercises.checkers import CHECKS  # noqa: E402
from tutorials.exercises.ex5_offload_victim import Candidate  # noqa: E402

# tutorial module -> a line its quick run must print
TUTORIALS = {
    "00_memory_bound": "KV cache per token of context: 144 KiB",
    "01_naive_speculation": "identical token for token: True",
    "02_pillar_attn": "Every run identical to plain greedy: True",
    "03_unified_batching": "outputs identical under both policies: True",
    "04_delayed_verification": "plain == sync == async, every request, token for token: True",
    "05_dynamic_kv_cache": "outputs identical with and without the bound: True",
    "06_all_together": "Qwen3-8B needs 16.4 GB of bf16 weights plus 144 KiB of KV per token: on an H200 (141 GB) "
                       "about 0.85 M tokens of KV.",
    "07_stale_selection": "Every run identical to plain greedy: True",
}


def check_all_together(out: str) -> None:
    """Tutorial 06 teaches how to read the CLI's summary and the benchmark's table: in its quick run (8 new tokens,
    k = 8; the bench with 2 requests of 8 tokens) the summary counts 8 tokens and at most the drafts offered, each
    offering at most k; every bench row is there, writing plain decoding's tokens (greedy), the speculative rows with
    their accepted drafts out of k = 4."""
    summary = re.search(r"^\[stderr\] 8 tokens in [0-9.]+ s: [0-9.]+ tok/s; ([0-9.]+) of ([0-9.]+) drafts accepted "
                        r"per verification$", out, re.M)
    assert summary, out[-3000:]
    accepted, offered = float(summary[1]), float(summary[2])
    assert 0 <= accepted <= offered <= 8, summary[0]
    rows = dict(re.findall(r"^\| (plain|pillar-naive|\+balanced|\+async) \|(.*)$", out, re.M))
    assert list(rows) == ["plain", "pillar-naive", "+balanced", "+async"], out[-3000:]
    for name, cells in rows.items():
        cells = [c.strip() for c in cells.split("|")]
        assert cells[-2] == "2/2 (8)", (name, cells)                         # = plain: both requests, all 8 tokens
        acc = re.fullmatch(r"([0-9.]+) / 4", cells[3])
        assert (acc is None) == (name == "plain") and (acc is None or float(acc[1]) <= 4), (name, cells)


FIGURES = {"06_all_together": check_all_together}   # tutorial module -> a check of the figures its quick run prints


@pytest.fixture(scope="module")
def embedded_tokenizer():
    """The quick mode's tiny model borrows the embedded model's tokenizer: convert it once, or skip."""
    from nano_sparsespec.embedded import INSTALL_HINT, embedded_model_dir
    try:
        return embedded_model_dir()
    except FileNotFoundError:
        pytest.skip(f"the embedded model is not installed ({INSTALL_HINT})")


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_in_quick_mode(name, embedded_tokenizer):
    done = subprocess.run([sys.executable, "-m", f"tutorials.{name}", "--quick", "--no-plot"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert TUTORIALS[name] in done.stdout, done.stdout[-3000:]
    if name in FIGURES:
        FIGURES[name](done.stdout)


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


def _victim(oldest=False, ignore_scheduled=False, no_last_guard=False):
    def pick_victim(running: list[Candidate]):
        if not no_last_guard and (len(running) <= 1 or sum(c.scheduled for c in running) <= 1):
            return None
        movable = [c for c in running if (c.scheduled or ignore_scheduled) and not c.awaiting_result]
        if not movable:
            return None
        pick = min if oldest else max
        return pick(movable, key=lambda c: c.admitted_at).seq_id
    return types.SimpleNamespace(pick_victim=pick_victim)


PLANTED = {
    1: [_greedy(count_all=True), _greedy(ignore_num_drafts=True), _greedy(bonus_from_last_row=True)],
    2: [_rejection(residual_is_p=True), _rejection(inverted_test=True)],
    3: [_critical(strided_groups=True), _critical(ignore_context=True), _critical(unweighted_rows=True)],
    4: [_phases(round_robin=True), _phases(ignore_stall=True), _phases(no_stall_step=True)],
    5: [_victim(oldest=True), _victim(ignore_scheduled=True), _victim(no_last_guard=True)],
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
    assert sorted(PLANTED) == sorted(CHECKS) and len(CHECKS) >= 5


@pytest.mark.parametrize("n", sorted(CHECKS))
def test_student_file_ships_as_a_stub_the_checker_rejects(n):
    """The student's file ships as a stub whose functions raise NotImplementedError naming the exercise: its checker
    must call them and so fail on it (a checker that passed the stub would check nothing)."""
    module, _ = exercise_module(n, solution=False)
    with pytest.raises(NotImplementedError, match=f"exercise {n}: write "):
        CHECKS[n](module)


def test_check_command():
    ok = subprocess.run([sys.executable, "-m", "tutorials.check", "1", "--solution"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "all checks passed" in ok.stdout, ok.stdout + ok.stderr
    stub = subprocess.run([sys.executable, "-m", "tutorials.check", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert stub.returncode == 1 and "not written yet" in stub.stdout, stub.stdout + stub.stderr
