"""The tutorials: every one runs in --quick mode (a subprocess, as a reader runs it) and must exit 0 and print its key
line(s); the figures a tutorial teaches are checked too. The exercise checkers are tested in test_exercises.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `tutorials` is a folder of the checkout, not part of the installed package

# tutorial module -> a line (or lines) its quick run must print
TUTORIALS = {
    "00_memory_bound": "KV cache per token of context: 144 KiB",
    "01_build_it_yourself": ("same as the engine's plain decoding: True", "12 of 12 drafts accepted",
                             "chi-square test passes: True",
                             "greedy speculative output equals plain greedy output, token for token: True"),
    "02_naive_speculation": "identical token for token: True",
    "03_pillar_attn": "Every run identical to plain greedy: True",
    "04_unified_batching": "outputs identical under both policies: True",
    "05_delayed_verification": "plain == sync == async == ahead, every request, token for token: True",
    "06_dynamic_kv_cache": "outputs identical with and without the bound: True",
    "07_all_together": "Qwen3-8B needs 16.4 GB of bf16 weights plus 144 KiB of KV per token: on an H200 (141 GB) "
                       "about 0.85 M tokens of KV.",
    "08_stale_selection": "Every run identical to plain greedy: True",
}


def check_all_together(out: str) -> None:
    """Tutorial 07 teaches how to read the CLI's summary and the benchmark's table: in its quick run (8 new tokens,
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


FIGURES = {"07_all_together": check_all_together}   # tutorial module -> a check of the figures its quick run prints


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
    if name in FIGURES:
        FIGURES[name](done.stdout)


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
