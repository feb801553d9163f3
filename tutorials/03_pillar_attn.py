"""Tutorial 03: PillarAttn, critical tokens picked for free by the verification's own attention.

    python -m tutorials.03_pillar_attn            # about two minutes on a laptop CPU
    python -m tutorials.03_pillar_attn --quick    # seconds, tiny random model
    python tutorials/03_pillar_attn.py --quick    # the same, run as a file

A sparse drafter is only as good as the positions it attends to. StreamingLLM keeps a fixed window: the first tokens
(attention "sinks") and the most recent ones. PillarAttn lets the model choose: a verification step computes full
attention anyway, so its attention probabilities, averaged over the verification's k + 1 query rows and over the
query heads of each GQA group, score every position for every (layer, KV head). The top B positions become the
critical set the next k drafts attend to, plus the tokens written since. The name comes from the picture: the same
positions are chosen verification after verification, vertical pillars in the attention map.

The script decodes the prompt of tutorial 02 (247 tokens; 48 new tokens, greedy, k = 8) with the streaming and the
pillar drafter at budgets of 8, 16, 32 and 64 positions per (layer, KV head). During the pillar runs it records, through
the engine's `on_selection` callback, what PillarAttn ranked at every verification and what it chose: the real
scores [layers, KV heads, positions] and the real selection. Numbers from one default run on a 2-core cloud VM:

1. What one verification's attention looks like (budget 32). 11 captures: one after the prefill (scored by the
   prompt's last row), then one per verification. For the last verification, layer 15, KV head 0, the 8 highest
   scores: position 0, '<|im_start|>', with 0.34 (a sink), then recent tokens ('.', ' takes', '\n', ...). The 32
   selected positions, 11% of the context, hold 80% of the attention on average over all layers and heads (the
   least, 27%, in layer 0, whose attention is spread thin).

2. The pillars. One text row per capture for layer 15, KV head 0, three positions per character, '#' where a
   position is selected. Column 0 (the sink) is chosen every time; a band at the start of the question ("Question:
   On a Saturday", positions ~195-203) and the newest tokens come back row after row. Over all captures, layers and
   KV heads: position 0 is chosen 86% of the time, the newline after 'assistant' that ends the prompt 69%, the
   question mark and the answer's own ' calculate the total' about half the time.

3. Are last verification's pillars still right for the next drafts? The drafts between two verifications use a
   selection made one cycle earlier. The script measures how much of the NEXT verification's attention they could
   see (their selection plus the positions written since), averaged over 10 cycles and all layers and heads:
       PillarAttn (from the previous verification)       78.8%
       StreamingLLM (sinks + recent), same budget        58.8%
       oracle (top-B of the next verification itself)    82.0%
   A one-cycle-old PillarAttn selection is nearly as good as the oracle: attention drifts slowly.

4. Acceptance vs budget (drafts accepted per verification, out of 8):
       budget  streaming: accepted  pillar: accepted  pillar: tokens/verification
            8                 1.65               1.3                          2.3
           16                 2.21              2.29                         3.29
           32                 2.46               3.6                          4.6
           64                  3.5              5.43                         6.43
   With 8 positions both are starved (4 sinks + 4 recent tokens is as good a guess as any); from 32 on, PillarAttn
   pulls away. Every run is identical to plain greedy decoding, which the script checks.

5. The same scores without the probabilities. The scores above come from every row's probability of every
   position (float32, per layer and KV head). The GPU's fast path never writes those. Its attention pass returns
   each row's log-sum-exp lse(row), and exp(q.k / sqrt(D) - lse(row)) is that row's probability of a position. So
   a second flex_attention pass with queries and keys swapped, each position's key attending to the rows of its KV
   head with lse(row) - log(weight / G) subtracted, has as its log-sum-exp the log of the position's score
   (`swapped_scores.column_scores`): the keys are read once more and nothing else is written. The script checks it
   on one random verification (9 rows, 300 positions): largest score 0.012, largest difference 4.0e-09.

With matplotlib: tutorials/out/03_pillar_attn.png, the log scores of four layers (rows: successive captures,
columns: positions, red ticks: the selected positions) and acceptance against budget. What it shows, honestly: each
row is one verification's score vector, averaged over its query rows and a GQA group, not the attention map of a
single query; that averaged vector is exactly what PillarAttn ranks. Exercise 3 asks you to compute it and pick the
top B yourself.

The engine does one thing more by default, as the official SparseSpec code does: the positions a verification
has just accepted (its pending token and the accepted drafts) join the next selection first, in place of its
lowest-ranked positions (`SpecConfig.keep_accepted`). Measured over 4 reasoning prompts x 1,024 tokens (k = 8,
budget 128, text that cannot loop; BENCHMARKS.md, Acceptance): PillarAttn 5.98 -> 6.11 accepted of 8,
pillar-lookup 6.63 -> 6.72. This script switches it off so that the selections it shows are PillarAttn's alone.

Next: tutorial 04 runs many requests at once and staggers their verifications.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import warnings

import torch

from nano_sparsespec import SamplingParams, attention, pillar_attn, swapped_scores

from tutorials._common import PROMPT, load_llm, parser, save_plot, section, start, table, with_spec


class Captures(list):
    """The engine's `on_selection` callback as a list: `llm.generate(..., on_selection=captures.record)` appends, at
    every refresh of a request's critical positions, (scores [L, n_kv, context], selection [L, n_kv, budget]): what
    PillarAttn ranked and what it chose, best first. Streaming runs pass no scores: nothing is kept."""

    def record(self, seq, scores, selection) -> None:
        if scores is not None:
            self.append((scores.float().cpu().clone(), selection.cpu().clone()))


def token_text(llm, token: int) -> str:
    """A token as text, special tokens included (position 0 is the chat template's '<|im_start|>')."""
    return repr(llm.tokenizer.decode([token]))


def covered(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Attention mass on the chosen positions: scores [L, n_kv, n], positions [L, n_kv, m] -> [L, n_kv]."""
    return scores.gather(-1, positions).sum(-1)


def selection_rows(records, layer: int, head: int, width: int) -> list[str]:
    """One text row per verification: '#' where a bucket of positions holds a selected one, '.' where not."""
    longest = max(s.shape[-1] for s, _ in records)
    per_char = -(-longest // width)
    rows = []
    for scores, chosen in records:
        cells = ["." if c * per_char < scores.shape[-1] else " " for c in range(width)]
        for p in chosen[layer, head].tolist():
            cells[p // per_char] = "#"
        rows.append("".join(cells))
    return rows


def swapped_pass_difference(seed: int = 0) -> tuple[float, float]:
    """One verification of 9 rows over 300 positions (random queries and keys, 9 query heads on 3 KV heads): the
    PillarAttn scores from explicit probabilities (`pillar_attn.pillar_scores`) against the fast path's swapped pass
    (`swapped_scores.column_scores`, fed the rows' log-sum-exps as the attention pass returns them) -> (largest score,
    largest absolute difference)."""
    g = torch.Generator().manual_seed(seed)
    rows, heads, kv_heads, dim, context = 9, 9, 3, 64, 300
    q = torch.randn(1, rows, heads, dim, generator=g)
    k = torch.randn(1, context, kv_heads, dim, generator=g)
    q_start, valid = torch.tensor([context - rows]), torch.ones(1, rows, dtype=torch.bool)
    mask = attention.causal_mask(q_start, valid, context)                         # [1, rows, context]
    weight = valid.float() / rows
    lse = pillar_attn.attention_logits(q, k, mask).logsumexp(-1).flatten(2)       # [1, kv_heads, G * rows]
    explicit = pillar_attn.pillar_scores(q, k, mask, weight)                      # [1, kv_heads, context]
    with warnings.catch_warnings():   # uncompiled flex_attention warns that it is not the fused kernel
        warnings.simplefilter("ignore")
        swapped = swapped_scores.column_scores(q, k.transpose(1, 2), q_start, weight, lse)
    return explicit.max().item(), (swapped - explicit).abs().max().item()


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 03: PillarAttn")
    llm = load_llm(args)
    cfg = llm.model.config
    ids = llm.encode(PROMPT)
    new_tokens, k = (16, 4) if args.quick else (48, 8)
    budgets, shown = ((8, 16), 16) if args.quick else ((8, 16, 32, 64), 32)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    print(f"prompt: {len(ids)} tokens; {new_tokens} new tokens, greedy, k = {k}")

    with_spec(llm, method="plain")
    plain = llm.generate(None, params, prompt_token_ids=[ids])[0]
    runs = {}                                                  # (method, budget) -> (stats summary, same as plain)
    for budget in budgets:
        for method in ("streaming", "pillar"):
            with_spec(llm, method=method, stride=k, min_budget=budget, budget_ratio=0.01,
                      keep_accepted=False)            # PillarAttn's own choice (see the docstring)
            records = Captures()
            out = llm.generate(None, params, prompt_token_ids=[ids], on_selection=records.record)[0]
            runs[method, budget] = (llm.last_stats.summary(k), out.token_ids == plain.token_ids)
            if method == "pillar" and budget == shown:
                captured = records
    tokens = ids + plain.token_ids

    section(f"1. What one verification's attention looks like (pillar run, budget {shown})")
    print(f"{len(captured)} captures: one after the prefill (its last prompt row), then one per verification "
          f"(the mean over its {k + 1} query rows). Each holds scores [layers={cfg.num_layers}, KV heads="
          f"{cfg.num_kv_heads}, positions]: attention probabilities averaged over the query rows and over the "
          f"{cfg.group_size} query heads of each KV head's GQA group. A row sums to 1.")
    scores, chosen = captured[-1]                              # [L, n_kv, n], [L, n_kv, B]
    layer = cfg.num_layers // 2
    top = scores[layer, 0].topk(8)
    print(f"last verification, layer {layer}, KV head 0, context {scores.shape[-1]}: the 8 highest scores")
    table(["position", "token", "score"],
          [[p, token_text(llm, tokens[p]), round(v, 4)] for v, p in zip(top.values.tolist(), top.indices.tolist())])
    mass = covered(scores, chosen)                             # [L, n_kv]
    print(f"the {chosen.shape[-1]} selected positions per (layer, head) ({chosen.shape[-1] / scores.shape[-1]:.0%} of "
          f"the context) hold {mass.mean():.0%} of the attention on average (least: {mass.min():.0%}, "
          f"layer {int(mass.min(1).values.argmin())})")

    section(f"2. The pillars: positions selected at each verification (layer {layer}, KV head 0)")
    print("one row per capture, time flows down; '#' = a selected position in that column's bucket of positions")
    for n, row in enumerate(selection_rows(captured, layer, 0, width=100)):
        print(f"  {n:3d} |{row}|")
    counts = torch.zeros(max(s.shape[-1] for s, _ in captured))
    for _, sel in captured:
        counts.index_add_(0, sel.flatten(), torch.ones(sel.numel()))
    share = counts / (len(captured) * cfg.num_layers * cfg.num_kv_heads)
    print("positions chosen most often, over all captures, layers and KV heads:")
    table(["position", "token", "chosen in"],
          [[p, token_text(llm, tokens[p]), f"{share[p]:.0%}"] for p in share.topk(8).indices.tolist()])

    section("3. Are last verification's pillars still right for the next drafts?")
    stale, fresh, stream = [], [], []
    for (before, sel), (after, _) in zip(captured, captured[1:]):
        window = torch.arange(before.shape[-1], after.shape[-1]).expand(*sel.shape[:2], -1)  # written since `before`
        streaming = pillar_attn.select_streaming(before.shape[-1], sel.shape[-1], llm.spec.sink_tokens,
                                                 cfg.num_layers, cfg.num_kv_heads)
        oracle = after[..., :before.shape[-1]].topk(sel.shape[-1]).indices
        for store, picked in ((stale, sel), (stream, streaming), (fresh, oracle)):
            store.append(covered(after, torch.cat([picked, window], -1)).mean())
    print(f"share of the NEXT verification's attention that the drafts in between could see (their selection plus the "
          f"positions written since), averaged over {len(stale)} cycles, all layers and heads:")
    table(["selection", "attention covered"],
          [["PillarAttn (from the previous verification)", f"{torch.stack(stale).mean():.1%}"],
           ["StreamingLLM (sinks + recent), same budget", f"{torch.stack(stream).mean():.1%}"],
           ["oracle (top-B of the next verification itself)", f"{torch.stack(fresh).mean():.1%}"]])

    section("4. Acceptance vs budget (positions per layer and KV head)")
    rows = [[b, runs["streaming", b][0]["mean_accepted"], runs["pillar", b][0]["mean_accepted"],
             runs["pillar", b][0]["tokens_per_verification"]] for b in budgets]
    table(["budget", "streaming: accepted", "pillar: accepted", "pillar: tokens/verification"], rows)
    print(f"drafts accepted per verification, out of up to {k}. Every run identical to plain greedy: "
          f"{all(same for _, same in runs.values())}")

    section("5. The same scores without the probabilities (the GPU's fast path)")
    largest, difference = swapped_pass_difference()
    print("score of a position = sum over rows of weight x exp(q.k / sqrt(D) - lse(row)): the log-sum-exp of a pass "
          "in which the position's key attends to the rows, each row's lse subtracted")
    print(f"one verification (9 rows, 300 positions, random): largest score {largest:.3f}, largest difference "
          f"between explicit probabilities and the swapped pass {difference:.1e}")

    def draw(plt):
        layers = sorted({0, cfg.num_layers // 3, layer, cfg.num_layers - 1})
        width = max(s.shape[-1] for s, _ in captured)
        fig, axes = plt.subplots(len(layers) + 1, 1, figsize=(10, 2.2 * len(layers) + 3))
        for ax, l in zip(axes, layers):
            image = torch.full((len(captured), width), float("nan"))
            for r, (s, sel) in enumerate(captured):
                image[r, :s.shape[-1]] = s[l, 0].clamp(min=1e-5).log10()
                ax.scatter(sel[l, 0], [r] * sel.shape[-1], s=12, c="red", marker="|", linewidths=0.8)
            ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis")
            ax.set(title=f"layer {l}, KV head 0: log10 attention score; red = selected", ylabel="verification")
        axes[len(layers) - 1].set_xlabel("position")
        ax = axes[-1]
        for method in ("streaming", "pillar"):
            ax.plot(budgets, [runs[method, b][0]["mean_accepted"] for b in budgets], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set(xlabel="budget (positions per layer and KV head)", ylabel=f"drafts accepted of {k}",
               title="acceptance vs budget")
        ax.legend()

    save_plot(args, "03_pillar_attn", draw)


if __name__ == "__main__":
    main()
