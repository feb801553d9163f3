"""Tutorial 08 (beyond the paper): why a PillarAttn selection goes stale during drafting, and what keeps it fresh.

    python -m tutorials.08_stale_selection            # about two minutes on a laptop CPU
    python -m tutorials.08_stale_selection --quick    # seconds, tiny random model
    python tutorials/08_stale_selection.py --quick    # the same, run as a file

BEYOND THE PAPER. SparseSpec's paper stops at PillarAttn (tutorial 03). This tutorial measures where its selection
falls short and tries fixes that are this repository's own: token lookup (`pillar-lookup`) and the selection
variants of section 3 are not in the paper, and their figures are not the paper's.

PillarAttn picks a request's critical positions once per cycle, from the attention of the verification, and the
next k drafts attend to that selection plus the tokens written since. Draft j's query is j tokens further on than
the newest query the selection was scored with: whatever it needs that the verification did not need is missing.
The ideal is the *per-step top-B bound*: every draft step attends to the B positions its own full attention ranks
highest. That costs a full attention pass per draft (the very thing drafting avoids), so it is a bound, not a drafter.

This script measures the gap directly. It decodes the prompt of tutorial 02 greedily with `pillar` (budget 32
positions per layer and KV head, about a tenth of the context; k = 8) and records, through the engine's
`on_selection` callback, the scores and the selection of every verification. The engine does not hand out the
attention of each query row, so the script recomputes it from the final text: one causal forward pass of the model,
with a torch forward hook on each layer's attention catching its input, gives every position's exact attention
probabilities, per layer, KV head and query row (`attention_rows`; the prompt's last row is checked against the
scores the engine ranked). A verification's row j is draft step j's query computed exactly, so for every cycle and
draft step the script can say how much of that step's attention the drafter saw: the attention mass on its
selection plus the positions written since the verification, averaged over layers and KV heads. Rows of rejected
drafts are left out: their tokens are not in the text. Numbers from one default run on a 2-core cloud VM (22
cycles):

1. Attention mass seen, by draft step j: StreamingLLM 62-71%, the stale PillarAttn selection 83-89%, the per-step
   top-B bound 88-91%. On average the stale selection loses only ~4 points of attention mass to the bound, and
   hardly more for late drafts than for early ones. Averaged mass hides where staleness bites.

2. The one position each (layer, KV head) attends to most. PillarAttn sees it for 99.0% of the 90 pairs, but a draft
   needs all of them right: only 52% of draft steps see every pair's top position. Token lookup (method
   `pillar-lookup`: at each draft step, the latest m earlier occurrences p of the draft's input token and p + 1
   replace the lowest-ranked critical positions, same budget) raises that to 66-70% while the mass barely moves.
   The misses are a few sharp heads, the duplicate-token and induction heads that point at one earlier occurrence
   of the current token: the verification's queries did not ask for that token, so no selection made there can
   hold it, and one wrong head can flip a draft's argmax. The draft's own input token names the position.

3. Other choices at the verification, same budget, no lookup (all steps seeing every top position): PillarAttn 52%;
   only the rows of tokens that stay (dropping the rejected drafts' rows) 35%, worse, because the rejected drafts'
   rows are the queries nearest to the next cycle's drafts; over those same kept rows, max instead of mean over rows
   and heads 45% (a sharp head's target survives the max); a quarter of the budget pinned to 4 sinks + the most
   recent positions 57%. The rejected drafts' rows are not in the text, so the max is taken over the kept rows only.
   These variants are computed here, in this script; the engine offers none of them. A proxy, not acceptance.

4. Acceptance on this one prompt (drafts accepted per verification, of 8): pillar against pillar-lookup with its
   default m = 8 matches (3.13 against 4.94 in the quoted run). One prompt of 96 tokens cannot rank m (here m = 2
   and m = 4 even see every head's top position more often than m = 8); the 4-prompt x 1,024-token sweep in
   BENCHMARKS.md ("Design notes") chose m = 8: 7.13 accepted against 6.92 (m = 4) and 6.69 (m = 2) on free greedy
   text. Every run is identical to plain greedy decoding, which the script checks.

Plot: tutorials/out/08_stale_selection.png, staleness by draft step j: the attention mass each drafter misses
against the per-step top-B bound, and the share of draft steps that see every head's most-attended position.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from nano_sparsespec import SamplingParams, lookup, pillar_attn
from nano_sparsespec.model import apply_rope

from tutorials._common import PROMPT, load_llm, parser, save_plot, section, start, table, with_spec

# The drafter this tutorial ends with.
FINAL = dict(method="pillar-lookup")


class Selections(list):
    """The engine's `on_selection` callback as a list: `llm.generate(..., on_selection=selections.record)` appends
    one dict per refresh of the request's critical positions (after its last prefill chunk, then after every
    verification):
        scores     [L, n_kv, context] what PillarAttn ranked: the verification's rows' attention, averaged
        selection  [L, n_kv, B] what it chose, best first
        context    the verified context after the verification (the selection's positions are below it)"""

    def record(self, seq, scores, selection) -> None:
        self.append(dict(scores=scores.float().cpu().clone(), selection=selection.cpu().clone(),
                         context=scores.shape[-1]))


@torch.inference_mode()
def attention_rows(llm, tokens: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact attention probabilities of the queries at positions first.. of `tokens`, recomputed from the text.

    One causal forward pass of the model over `tokens`; a forward hook on each layer's attention module catches its
    input hidden states, from which that module's own weights give q and k (`qkv_proj`, the q/k norms if the model
    has them, RoPE at the tokens' positions) and `pillar_attn.attention_probs` the probabilities, as a verification
    computes them. A verification's row at position c + j (the pending token, then draft j) sees exactly this when
    its drafts up to j were accepted: the same tokens at the same positions, the same context.
    -> mean, max [L, n_kv, rows, len(tokens)] over the query heads of each KV head's GQA group; row r is position
    first + r, zero past it."""
    model, device = llm.model, llm.device
    inputs = []
    hooks = [layer.self_attn.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
             for layer in model.layers]
    try:
        positions = torch.arange(len(tokens), device=device)
        model(torch.tensor(tokens, device=device), positions)
    finally:
        for hook in hooks:
            hook.remove()
    cos, sin = model.rope(positions)
    rows = positions[first:]
    mask = (rows[:, None] >= positions[None, :])[None]                          # [1, rows, T] causal
    mean, peak = [], []
    for layer, x in zip(model.layers, inputs):
        attn = layer.self_attn
        q, k, _ = attn.qkv_proj(x).view(len(tokens), attn.n_heads + 2 * attn.n_kv, attn.head_dim).split(
            [attn.n_heads, attn.n_kv, attn.n_kv], dim=1)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        probs = pillar_attn.attention_probs(q[first:].float()[None], k.float()[None], mask)[0]   # [n_kv, G, R, T]
        mean.append(probs.mean(1))
        peak.append(probs.amax(1))
    return torch.stack(mean).cpu(), torch.stack(peak).cpu()


def seen(probs: torch.Tensor, positions: torch.Tensor, window: range) -> tuple[float, float, float]:
    """What a drafter attending to `positions` [L, n_kv, n] plus the `window` sees of one query's exact attention
    probs [L, n_kv, Lmax] (the positions lie below the window): (the attention mass on them, averaged over layers and
    KV heads; the share of (layer, KV head) whose most-attended position is among them; 1.0 if that holds for all)."""
    mass = probs.gather(-1, positions).sum(-1) + probs[..., window.start:window.stop].sum(-1)
    top = probs[..., :window.stop].argmax(-1)                                                   # [L, n_kv]
    hit = (top >= window.start) | (positions == top[..., None]).any(-1)
    return float(mass.mean()), float(hit.float().mean()), float(hit.all())


def lookup_selection(selection: torch.Tensor, tokens: list[int], context: int, position: int, matches: int):
    """What `pillar-lookup` attends to at the draft step whose input token sits at `position`: the selection with
    the token's lookups merged in (the engine's own `lookup_positions` + `merge_lookup`) -> [L, n_kv, n]."""
    ctx = torch.tensor([tokens[:context]])
    found, valid = lookup.lookup_positions(ctx, torch.tensor([tokens[position]]), torch.tensor([context]),
                                                matches, torch.tensor([tokens[position - 1]]))
    return lookup.merge_lookup(selection[None], torch.tensor([selection.shape[-1]]), found, valid)[0]


def sinks_recent_then_pillars(scores: torch.Tensor, context: int, n: int, fixed: int, sinks: int) -> torch.Tensor:
    """A budget split, computed here only: `fixed` positions go to the first `sinks` and the most
    recent ones before `context`, the top-scored others fill the rest of n. scores [L, n_kv, Lmax] -> [L, n_kv, n]."""
    first = min(sinks, fixed)
    pinned = torch.cat([torch.arange(first), torch.arange(context - (fixed - first), context)])
    ranked = scores[..., :context].clone()
    ranked[..., pinned] = float("inf")                      # pinned first, then by score
    return ranked.topk(n, dim=-1).indices


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 08: stale selections")
    llm = load_llm(args)
    cfg = llm.model.config
    ids = llm.encode(PROMPT)
    new_tokens, k, budget = (24, 4, 16) if args.quick else (96, 8, 32)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    print(f"prompt: {len(ids)} tokens; {new_tokens} new tokens, greedy, k = {k}, budget {budget} positions per "
          f"(layer, KV head)")
    spec = dict(stride=k, min_budget=budget, budget_ratio=0.01, batch_policy="naive", keep_accepted=False)

    with_spec(llm, method="plain")
    plain = llm.generate(None, params, prompt_token_ids=[ids])[0]
    with_spec(llm, method="pillar", **spec)
    records = Selections()
    out = llm.generate(None, params, prompt_token_ids=[ids], on_selection=records.record)[0]
    same = [out.token_ids == plain.token_ids]
    tokens = ids + out.token_ids
    # Every verification's kept rows (the pending token and the accepted drafts) are rows of the final text: its
    # attention, recomputed from the first scored row on (the prompt's last, which the prefill's scores come from).
    first = records[0]["context"] - 1
    mean_rows, max_rows = attention_rows(llm, tokens, first)            # [L, n_kv, rows, len(tokens)]
    drift = (mean_rows[..., 0, :first + 1] - records[0]["scores"]).abs().max()
    print(f"the prompt's last row, recomputed from the text, against the scores the engine ranked after the "
          f"prefill: largest difference {drift:.1e}")

    def kept_rows(i: int) -> slice:
        """Rows of record i's verification that stay in the text: its pending token and its accepted drafts."""
        start = records[i - 1]["context"] if i else first
        return slice(start - first, records[i]["context"] - first)

    # One entry per (cycle, draft step j): what each drafter would have seen of that step's exact attention.
    drafters = {"streaming (sinks + recent)": None, "pillar (stale)": None, "pillar + lookup (m=2)": 2,
                "pillar + lookup (m=4)": 4, "pillar + lookup (m=8)": 8}
    cover = {name: {} for name in [*drafters, "per-step top-B bound"]}   # name -> j -> [(mass, top seen) per cycle]
    variants = {"pillar (stale), as the engine chose": [], "mean over kept rows only": [],
                "max over kept rows and heads": [], "a quarter of B pinned to sinks + recent": []}
    for i, (prev, cur) in enumerate(zip(records, records[1:])):
        c, sel = prev["context"], prev["selection"]                     # the cycle's drafts attend to sel + window
        n = sel.shape[-1]
        accepted = cur["context"] - c - 1
        streaming = pillar_attn.select_streaming(c, n, llm.spec.sink_tokens, cfg.num_layers, cfg.num_kv_heads)
        # other selection policies, scored from the kept rows of the same (previous) verification
        rows = kept_rows(i)
        scored = {"mean over kept rows only": mean_rows[..., rows, :c].mean(-2),
                  "max over kept rows and heads": max_rows[..., rows, :c].amax(-2)}
        others = {"pillar (stale), as the engine chose": sel,
                  **{name: pillar_attn.select_pillar(s[:, None], [c], [n])[0] for name, s in scored.items()},
                  "a quarter of B pinned to sinks + recent":
                  sinks_recent_then_pillars(prev["scores"], c, n, round(0.25 * n), llm.spec.sink_tokens)}
        for j in range(min(accepted, k - 1) + 1):                       # draft step j's input sits at c + j
            probs = mean_rows[..., c + j - first, :]                    # [L, n_kv, T] its exact attention
            window = range(c, c + j + 1)
            best = probs[..., :c].topk(n, dim=-1).indices
            cover["per-step top-B bound"].setdefault(j, []).append(seen(probs, best, window))
            for name, matches in drafters.items():
                chosen = streaming if name.startswith("streaming") else sel if matches is None else \
                    lookup_selection(sel, tokens, c, c + j, matches)
                cover[name].setdefault(j, []).append(seen(probs, chosen, window))
            for name, chosen in others.items():
                variants[name].append(seen(probs, chosen, window))
    cycles = len(records) - 1

    def mean(values, i):
        return sum(v[i] for v in values) / max(1, len(values))

    steps = sorted(cover["pillar (stale)"])
    names = list(cover)
    every = {name: [v for j in steps for v in cover[name][j]] for name in names}
    section("1. How much of each draft step's attention the drafter sees")
    print(f"{cycles} cycles; rows: draft step j (its input token is j positions past the verified context); "
          f"columns: attention mass the drafter sees, averaged over layers, KV heads and the cycles that accepted "
          f"draft j")
    table(["j", "cycles"] + names,
          [[j, len(cover["pillar (stale)"][j])] + [f"{mean(cover[n][j], 0):.1%}" for n in names] for j in steps])

    section("2. The one position each head attends to most")
    print(f"per draft step, over all {cfg.num_layers * cfg.num_kv_heads} (layer, KV head) pairs: the share whose "
          f"most-attended position the drafter sees, and the draft steps where every pair sees it")
    head = ["attention mass seen", "most-attended position seen", "draft steps seeing every one"]
    table(["drafter"] + head, [[n] + [f"{mean(every[n], i):.1%}" for i in range(3)] for n in names])

    section("3. Other ways to choose at the verification (same cycles, same budget, no lookup)")
    table(["selection"] + head, [[n] + [f"{mean(v, i):.1%}" for i in range(3)] for n, v in variants.items()])

    section("4. Acceptance (drafts accepted per verification, out of up to k)")
    runs = [("pillar (the paper's PillarAttn)", dict(method="pillar")),
            (f"{FINAL['method']} (beyond the paper; default m = 8 matches)", FINAL)]
    rows = []
    for label, changes in runs:
        with_spec(llm, **{**spec, **changes})
        got = llm.generate(None, params, prompt_token_ids=[ids])[0]
        same.append(got.token_ids == plain.token_ids)
        summary = llm.last_stats.summary(k)
        rows.append([label, summary["mean_accepted"], summary["tokens_per_verification"]])
    table(["drafter", "accepted", "tokens/verification"], rows)
    print("One prompt cannot rank m, the number of lookups: the 4-prompt x 1,024-token sweep of BENCHMARKS.md chose "
          "m = 8 (7.13 accepted of 8 against 6.92 for m = 4 and 6.69 for m = 2 on free greedy text).")
    print(f"Every run identical to plain greedy: {all(same)}")

    def draw(plt):
        # staleness: what each drafter misses at draft step j, against what the step's own top-B would have seen
        bound = "per-step top-B bound"
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for name in names:
            if name != bound:
                left.plot(steps, [mean(cover[bound][j], 0) - mean(cover[name][j], 0) for j in steps], marker="o",
                          label=name)
            right.plot(steps, [mean(cover[name][j], 2) for j in steps], marker="o", label=name)
        left.set(xlabel="draft step j (tokens past the verification)", ylabel="attention mass missed",
                 title="mass the per-step top-B bound sees and the drafter misses")
        right.set(xlabel="draft step j (tokens past the verification)", ylim=(0, 1.05),
                  ylabel="share of draft steps", title="every head's most-attended position seen")
        right.legend(fontsize=7)

    save_plot(args, "08_stale_selection", draw)


if __name__ == "__main__":
    main()
