"""The tutorials and the exercise checkers.

Every tutorial runs in --quick mode (a subprocess, as a reader runs it) and must exit 0 and print its key line.
Every exercise checker is proven right both ways: it passes the reference solution and fails each planted wrong
implementation written below (each one a mistake a student could plausibly make).
"""
from __future__ import annotations

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

# tutorial module -> a line (or lines) its quick run must print
TUTORIALS = {
    "00_memory_bound": "KV cache per token of context: 144 KiB",
    "01_build_it_yourself": ("same as the engine's plain decoding: True", "12 of 12 drafts accepted",
                             "chi-square test passes: True",
                             "greedy speculative output equals plain greedy output, token for token: True"),
    "02_naive_speculation": "identical token for token: True",
    "03_pillar_attn": "Every run identical to plain greedy: True",
    "04_unified_batching": "outputs identical under both policies: True",
    "05_delayed_verification": "plain == sync == async, every request, token for token: True",
    "06_dynamic_kv_cache": "outputs identical with and without the bound: True",
    "07_all_together": "$ python -m nano_sparsespec.generate",
    "08_stale_selection": "Every run identical to plain greedy: True",
}


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
    lines = TUTORIALS[name] if isinstance(TUTORIALS[name], tuple) else (TUTORIALS[name],)
    assert all(line in done.stdout for line in lines), done.stdout[-3000:]


def test_build_it_yourself_teaches_what_it_says(embedded_tokenizer):
    """Tutorial 01's own functions on the tiny model: its dense cache matches the package's model, dense drafts are
    all accepted, sparse drafts over a budget that covers the context are too (they see what dense drafts see),
    greedy speculation equals plain greedy decoding with any budget, and its chi-square test accepts rejection
    sampling's output and rejects the raw drafts' (its quick run prints that: TUTORIALS above)."""
    import importlib
    from nano_sparsespec.model import load_model
    from tutorials._common import tiny_model_dir
    t = importlib.import_module("tutorials.01_build_it_yourself")
    torch.manual_seed(0)
    model = load_model(tiny_model_dir())
    ids = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    logits, _ = t.forward(model, t.DenseKV(model), ids)
    assert torch.allclose(logits, model.full_logits(torch.tensor(ids)), atol=1e-4)
    plain = model.full_logits(torch.tensor(ids)).argmax(-1)[-1:].tolist()
    for _ in range(11):
        plain.append(int(model.full_logits(torch.tensor(ids + plain)).argmax(-1)[-1]))
    dense, acc = t.speculate(model, ids, 12, 4)
    assert dense == plain and all(n == offered for n, offered in acc)
    covering, acc = t.speculate(model, ids, 12, 4, budget=len(ids) + 12)
    assert covering == plain and all(n == offered for n, offered in acc)
    for budget in (1, 4):
        assert t.speculate(model, ids, 12, 4, budget=budget)[0] == plain
    assert t.verify_greedy(torch.eye(5)[[1, 2, 0, 4]], [1, 2, 3]) == (2, 0)
    assert abs(t.chi_square_pvalue(14.067, 7) - 0.05) < 1e-4 and abs(t.chi_square_pvalue(9.488, 4) - 0.05) < 1e-4


@pytest.mark.parametrize("name", [*TUTORIALS, "check"])
def test_tutorial_runs_as_a_file(name):
    """`python tutorials/NN_name.py` works too: the script puts the repository root on the path."""
    done = subprocess.run([sys.executable, str(ROOT / "tutorials" / f"{name}.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "usage:" in done.stdout


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
def test_student_file_is_the_stub_or_correct(n):
    """The student's file ships as a stub whose function raises NotImplementedError; once written, it must pass."""
    module, _ = exercise_module(n, solution=False)
    try:
        CHECKS[n](module)
    except NotImplementedError as e:
        assert "exercise" in str(e)


def test_check_command():
    ok = subprocess.run([sys.executable, "-m", "tutorials.check", "1", "--solution"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "all checks passed" in ok.stdout, ok.stdout + ok.stderr
    stub = subprocess.run([sys.executable, "-m", "tutorials.check", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert stub.returncode == 1 and "not written yet" in stub.stdout, stub.stdout + stub.stderr


# ----------------------------------------------------------------------------------------------------------------------
# the tutorials watch the engine only through what it offers

def _imported_names(tree) -> set[str]:
    """Names a file binds by import: modules and whatever it takes from them (classes, functions)."""
    import ast
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tutorials").rglob("*.py")))
def test_tutorials_never_assign_to_a_module_or_class_attribute(path):
    """No `module.f = ...`, `Class.method = ...` or setattr on them: tutorials observe through callbacks and hooks."""
    import ast
    tree = ast.parse((ROOT / path).read_text())
    imported = _imported_names(tree)

    def root(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                yield from targets(element)
        else:
            yield node

    bad = []
    for node in ast.walk(tree):
        assigned = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in (t for a in assigned for t in targets(a)):
            if isinstance(target, ast.Attribute) and root(target) in imported:
                bad.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and root(node.args[0]) in imported:
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, f"{path} assigns to another module's or class's attribute:\n" + "\n".join(bad)


def _event(step, works, running, offloaded=()):
    from nano_sparsespec.async_loop import StepEvent
    return StepEvent(step, works, list(running), list(offloaded), started=float(step), launch_seconds=0.5,
                     kv_positions=0)


def test_step_log_records_the_engine_steps_and_fills_steps_that_launched_nothing():
    """`StepLog.record` as on_step: letters per request, and a gap in the step numbers (delayed verification, every
    request waiting for a result) becomes a step where the requests that verified just before stall."""
    from nano_sparsespec import SamplingParams
    from nano_sparsespec.scheduler import Sequence, Work
    from tutorials._common import StepLog

    a, b, c = (Sequence(i, [1, 2, 3], SamplingParams(), 0) for i in range(3))
    log = StepLog()
    b.results_in_flight = 1                            # b's verification of step 0 is still in flight at step 1
    log.record(_event(0, [Work(a, "verify", 3, 2), Work(b, "verify", 3, 2)], [a, b], [c]))
    log.record(_event(2, [Work(a, "draft", 5, 1)], [a, b], [c]))      # step 1 launched nothing
    assert [s.index for s in log.steps] == [0, 1, 2]
    assert log.steps[0].actions == {0: "V", 1: "V", 2: "o"} and log.steps[0].tokens == 4
    assert log.steps[1].actions == {0: "s", 1: "s", 2: "o"} and log.steps[1].tokens == 0
    assert (log.steps[1].running, log.steps[1].offloaded) == (2, 1)
    assert log.steps[2].actions == {0: "D", 1: "s", 2: "o"}
    assert log.steps[2].launch_seconds == 0.5 and log.durations()[0] != log.durations()[0]   # nan: no timing
