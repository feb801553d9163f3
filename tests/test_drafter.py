"""The `pillar-lookup` drafter (the acceptance sweep in BENCHMARKS.md chose it, with 8 lookup matches by default): its
token-lookup selection against explicit references, its configuration, and greedy equality with plain decoding on a
tiny random Qwen3 across strides, batch policies, delayed verification and offload."""
import itertools

import pytest
import torch

from conftest import run
from nano_sparsespec import lookup as pillar_lookup
from nano_sparsespec.config import SpecConfig
from nano_sparsespec.lookup import lookup_positions, merge_lookup
from nano_sparsespec.pillar_attn import select_pillar
from nano_sparsespec.runner import ModelRunner
from nano_sparsespec.step_lists import StepLists


# ----------------------------------------------------------------------------------------------------------------------
# the selection functions against explicit references

def lookup_reference(tokens: list[int], token: int, context_len: int, matches: int, prev: int | None) -> list[int]:
    """p < context_len with tokens[p] == token: bigram matches (tokens[p - 1] == prev) first, each group latest
    first; the first `matches` of them give p and p + 1 (if < context_len), each position listed once."""
    hits = [p for p in range(context_len - 1, -1, -1) if tokens[p] == token]
    bigram = [p for p in hits if prev is not None and p > 0 and tokens[p - 1] == prev]
    found = (bigram + [p for p in hits if p not in bigram])[:matches]
    out = []
    for p in found:
        for q in (p, p + 1):
            if q < context_len and q not in out:
                out.append(q)
    return out


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_prev", [False, True])
def test_lookup_positions_matches_reference(with_prev, m):
    g = torch.Generator().manual_seed(m)
    B, Lc = 64, 30
    context = torch.randint(0, 4, (B, Lc), generator=g)            # a small vocabulary: many repeats, runs "x x"
    tokens = torch.randint(0, 5, (B,), generator=g)               # token 4 never occurs: nothing found
    prev = torch.randint(0, 4, (B,), generator=g) if with_prev else None
    lens = torch.randint(1, Lc + 1, (B,), generator=g)
    positions, valid = lookup_positions(context, tokens, lens, m, prev)
    assert positions.shape == valid.shape == (B, 2 * m)
    # the runner reads the K/V of every position, found or not: none lies past the verified context
    assert (positions <= lens.clamp(min=1)[:, None]).all() and (positions >= 0).all()
    for b in range(B):
        got = positions[b][valid[b]].tolist()
        ref = lookup_reference(context[b].tolist(), int(tokens[b]), int(lens[b]), m,
                               None if prev is None else int(prev[b]))
        assert got == ref, b


def test_lookup_positions_layout_and_edges():
    context = torch.tensor([[7, 7, 3, 7, 9, 9]])
    positions, valid = lookup_positions(context, torch.tensor([7]), torch.tensor([4]), 3)   # position 4+ not verified
    # latest first: p=3 (p+1=4 is the unverified window), p=1 (p+1=2), p=0 (p+1=1 already listed)
    assert positions.tolist() == [[3, 4, 1, 2, 0, 1]]
    assert valid.tolist() == [[True, False, True, True, True, False]]
    positions, valid = lookup_positions(context, torch.tensor([9]), torch.tensor([6]), 4)    # fewer hits than matches
    assert positions[valid].tolist() == [5, 4]
    positions, valid = lookup_positions(context[:, :2], torch.tensor([7]), torch.tensor([2]), 5)   # matches > Lc
    assert positions.shape == (1, 10) and positions[valid].tolist() == [1, 0]
    # with the previous token: 7 after 3 (position 3) is the bigram match, listed before the later-found others
    positions, valid = lookup_positions(torch.tensor([[7, 3, 7, 5, 7, 9]]), torch.tensor([7]), torch.tensor([6]), 2,
                                        torch.tensor([3]))
    assert positions[valid].tolist() == [2, 3, 4, 5]


def merge_reference(selection: list[int], lookup: list[int]) -> list[int]:
    """Drop what the lookup holds, keep the best-ranked rest so that kept + lookup = len(selection), then the lookup."""
    rest = [p for p in selection if p not in lookup]
    return rest[:len(selection) - len(lookup)] + lookup


def test_merge_lookup_matches_reference():
    g = torch.Generator().manual_seed(1)
    B, L, n_kv, N, ctx = 16, 3, 2, 10, 24
    selection = torch.stack([torch.stack([torch.stack([torch.randperm(ctx, generator=g)[:N] for _ in range(n_kv)])
                                          for _ in range(L)]) for _ in range(B)])        # distinct positions, ranked
    sel_len = torch.randint(6, N + 1, (B,), generator=g)
    lookup = torch.stack([torch.randperm(ctx, generator=g)[:6] for _ in range(B)])
    lookup_valid = torch.rand(B, 6, generator=g) < 0.7
    merged = merge_lookup(selection, sel_len, lookup, lookup_valid)
    assert merged.shape == selection.shape                    # same width: a draft gathers no more than before
    for b in range(B):
        look = lookup[b][lookup_valid[b]].tolist()
        n = int(sel_len[b])
        for l, h in itertools.product(range(L), range(n_kv)):
            ref = merge_reference(selection[b, l, h, :n].tolist(), look)
            assert merged[b, l, h, :n].tolist() == ref
            assert len(set(ref)) == n                         # the budget holds and nothing is attended twice


def test_merge_lookup_keeps_a_small_context_whole():
    """Context shorter than the budget: the selection is every position; lookups are all among them, none is lost."""
    ctx = 6
    selection = select_pillar(torch.rand(1, 1, 1, ctx), [ctx], [16])[0][None]           # [1, L, n_kv, 6]
    lookup, valid = lookup_positions(torch.tensor([[1, 2, 1, 3, 1, 2]]), torch.tensor([1]), torch.tensor([ctx]), 2)
    merged = merge_lookup(selection, torch.tensor([ctx]), lookup, valid)
    assert sorted(merged[0, 0, 0].tolist()) == list(range(ctx))


def test_spec_rejects_budget_below_lookups():
    with pytest.raises(ValueError, match="lookup_matches"):
        SpecConfig(method="pillar-lookup", min_budget=6, lookup_matches=4)
    with pytest.raises(ValueError, match="lookup_matches"):
        SpecConfig(method="pillar-lookup", lookup_matches=0)
    with pytest.raises(ValueError, match="min_budget=1 is too small"):
        SpecConfig(method="pillar-lookup", min_budget=1)


def test_default_lookup_matches():
    """8 by default (the measured best), capped at half of a smaller min_budget; an explicit value is taken as is."""
    assert SpecConfig(method="pillar-lookup").num_lookups == 8
    assert SpecConfig(method="pillar-lookup", min_budget=16).num_lookups == 8
    assert SpecConfig(method="pillar-lookup", min_budget=10).num_lookups == 5
    assert SpecConfig(method="pillar-lookup", min_budget=2).num_lookups == 1
    assert SpecConfig(method="pillar-lookup", lookup_matches=2).num_lookups == 2
    with pytest.raises(ValueError, match="min_budget=8 is too small for lookup_matches=8"):
        SpecConfig(method="pillar-lookup", min_budget=8, lookup_matches=8)


# ----------------------------------------------------------------------------------------------------------------------
# losslessness end to end


@pytest.mark.parametrize("stride", [1, 4, 8])
def test_strides(tiny_qwen3, prompts, plain_greedy, stride):
    _, outs = run(tiny_qwen3[0], prompts, method="pillar-lookup", stride=stride, min_budget=8, budget_ratio=0.1,
                  lookup_matches=2)
    assert [o.token_ids for o in outs] == plain_greedy


@pytest.mark.parametrize("policy,async_verify,kv_blocks", [("naive", False, 12), ("naive", True, 12),
                                                           ("balanced", False, 12), ("balanced", True, 12),
                                                           ("balanced", True, None)])
def test_greedy_is_lossless(tiny_qwen3, prompts, plain_greedy, policy, async_verify, kv_blocks):
    # The chosen design: pillar-lookup with its defaults (8 lookup matches), at a budget of 16 that they can fill.
    # max_batch 5 < 8 prompts: rows are reused by later requests (their device token mirror must restart);
    # kv_blocks=12 forces whole requests to the host pool and back.
    llm, outs = run(tiny_qwen3[0], prompts, method="pillar-lookup", stride=4, min_budget=16, budget_ratio=0.1,
                    batch_policy=policy, async_verify=async_verify, kv_blocks=kv_blocks, block_size=16, max_batch=5,
                    prefill_chunk=32)
    assert llm.spec.num_lookups == 8
    assert [o.token_ids for o in outs] == plain_greedy
    if kv_blocks is not None:
        assert llm.last_stats.offloads > 0 and llm.last_stats.restores == llm.last_stats.offloads


def test_lookup_changes_what_drafts_attend_to(tiny_qwen3, prompts):
    """Same budget, same verification scores: the per-step lookup must change some drafts (else it is not wired in)."""
    counts = {}
    for method in ("pillar", "pillar-lookup"):
        llm, _ = run(tiny_qwen3[0], prompts, method=method, stride=4, min_budget=8, budget_ratio=0.01,
                     lookup_matches=2)
        counts[method] = llm.last_stats.accepted_counts
    assert counts["pillar"] != counts["pillar-lookup"]


@pytest.mark.parametrize("method,refresh_every,keep_accepted", [
    ("pillar", 1, True), ("pillar", 3, True), ("pillar-lookup", 1, True), ("pillar-lookup", 3, True),
    ("pillar-lookup", 3, False), ("streaming", 1, True)])
def test_drafts_read_the_kv_of_their_positions(tiny_qwen3, prompts, plain_greedy, monkeypatch, method, refresh_every,
                                               keep_accepted):
    """At every draft step, the columns a draft attends to in its row of the draft buffers hold the pool's K/V of
    exactly its positions: its critical positions (for pillar-lookup `merge_lookup`'s, its lookups in the place of
    the lowest-ranked ones), then those written since the last verification; as many as a pillar draft's, its budget
    plus its window, in every (layer, KV head). (Its own column is written by the forward that follows.) The window
    expected is the scheduler's: the drafts the request has made since its last verification, this one included.
    A step of few drafts attends to copies of their rows (`attention.gathered`): its `valid` is then per draft. Kept
    selections (`refresh_every` > 1) copy only each verification's accepted positions, so their columns are checked as
    a set, as all are."""
    checked, drafting, lookups, selections, gathered = [], [], [], {}, set()
    sparse_lists, sparse_batch = StepLists._sparse_lists, ModelRunner._sparse_batch
    set_selections, lookup_draft_columns = ModelRunner.set_selections, pillar_lookup.lookup_draft_columns

    def noted_selections(self, seqs, positions, widths):                   # row -> [L, n_kv, n]
        selections.update({seq.row: positions[b, ..., :w] for b, (seq, w) in enumerate(zip(seqs, widths))})
        return set_selections(self, seqs, positions, widths)

    def noted_lists(self, plan):
        drafting[:] = [(w.seq, w.seq.num_drafts) for w, _ in plan.sparse]
        return sparse_lists(self, plan)

    def noted_lookup(seen, selection, rows, n_sel, *rest):                # merge_lookup's arguments
        found_at, found_valid, columns = lookup_draft_columns(seen, selection, rows, n_sel, *rest)
        lookups[:] = (selection[rows], n_sel, found_at, found_valid)
        return found_at, found_valid, columns

    def checked_batch(self, shape, dev, *inputs):
        batch = sparse_batch(self, shape, dev, *inputs)
        rows, n_sel = (dev[name].tolist() for name in ("sparse_row", "sparse_n_sel"))
        gathered.add(batch.read_row is None)
        critical = (merge_lookup(*lookups) if method == "pillar-lookup" else       # kept ones: in rank order there
                    [self.selection[row] if self.keeps_selection else selections[row] for row in rows])
        columns = torch.arange(batch.valid.shape[-1])
        window = [drafts for _, drafts in drafting]                             # positions num_verified .. own
        assert dev["sparse_window"].tolist() == window
        for b, (row, (seq, _)) in enumerate(zip(rows, drafting)):
            own = n_sel[b] + self.lookups + window[b] - 1                        # the draft's own column
            recent = list(range(seq.num_verified, seq.num_verified + window[b] - 1))
            for layer, head in itertools.product(range(self.num_layers), range(self.n_kv)):
                seen = batch.valid[layer, row if batch.read_row is not None else b, head].cpu()
                positions = torch.tensor(critical[b][layer, head, :n_sel[b]].tolist() + recent)
                slots = self.cache.slots_of(seq.seq_id, positions)
                held = self.draft_k[layer, row, head].float().cpu()[columns[seen & (columns != own)]]
                wanted = self.cache.k[layer, :, head].float().cpu()[slots]
                projection = torch.randn(held.shape[-1], generator=torch.Generator().manual_seed(0))
                checked.append(int(seen.sum()) == n_sel[b] + window[b] and bool(seen[own]) and torch.allclose(
                    (held @ projection).sort().values, (wanted @ projection).sort().values))
        return batch

    monkeypatch.setattr(ModelRunner, "set_selections", noted_selections)
    monkeypatch.setattr(StepLists, "_sparse_lists", noted_lists)
    monkeypatch.setattr(ModelRunner, "_sparse_batch", checked_batch)
    monkeypatch.setattr(pillar_lookup, "lookup_draft_columns", noted_lookup)
    _, outs = run(tiny_qwen3[0], prompts, method=method, stride=4, min_budget=16, budget_ratio=0.1,
                  refresh_every=refresh_every, keep_accepted=keep_accepted)
    assert [o.token_ids for o in outs] == plain_greedy
    assert checked and all(checked)
    assert gathered == {False, True}      # steps that read the rows in place, steps of few drafts that copy them out
