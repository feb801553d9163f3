"""refresh_graphs.py: the recorded selection refresh stores what the eager refresh does. On a CPU the padded refresh
runs eagerly, after the warm-up run a recording makes (its second run must store what one run stores), so a run that
refreshes through it drafts exactly as one that refreshes eagerly: the same drafts, acceptances and sampled tokens
(draft tokens decide which of a verification's samples are kept). On a GPU the refresh is recorded and replayed."""
import pytest
import torch

from conftest import generate
from nano_sparsespec import SamplingParams
from nano_sparsespec import runner as runner_module
from nano_sparsespec.refresh_graphs import SelectionRefresh


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,refresh_every", [("pillar-lookup", 1), ("pillar", 3)])
def test_the_recorded_refresh_drafts_as_the_eager_one(tiny_qwen3, monkeypatch, method, refresh_every, device):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (10,), generator=g)]
    params = SamplingParams(max_new_tokens=64, temperature=0.8, seed=3, ignore_eos=True)
    options = dict(method=method, refresh_every=refresh_every, stride=4, min_budget=8, budget_ratio=0.1,
                   batch_policy="balanced", async_verify=True, cuda_graphs=True, max_batch=10, block_size=16,
                   device=device)
    refreshed, run = [], SelectionRefresh.run

    def counted_run(self, seqs, *args):
        refreshed.append(len(seqs))
        run(self, seqs, *args)

    monkeypatch.setattr(SelectionRefresh, "run", counted_run)
    llm, recorded = generate(tiny_qwen3[0], prompts, params, **options)
    accepted = llm.last_stats.accepted_counts
    assert sum(refreshed) >= len(accepted) > 50 and len(set(refreshed)) > 2, refreshed
    assert 0 < sum(accepted) < 4 * len(accepted)                # drafts are accepted, and rejected
    monkeypatch.setattr(runner_module, "SelectionRefresh", lambda *args: None)      # the eager refresh
    llm, eager = generate(tiny_qwen3[0], prompts, params, **options)
    assert eager == recorded
    assert llm.last_stats.accepted_counts == accepted
