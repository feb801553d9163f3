"""Tutorial 02: naive self-speculative decoding, and why greedy speculation never changes the output.

    python -m tutorials.02_naive_speculation            # under a minute on a laptop CPU
    python -m tutorials.02_naive_speculation --quick    # seconds, tiny random model
    python tutorials/02_naive_speculation.py --quick    # the same, run as a file

Speculative decoding writes several tokens per expensive step: a cheap *drafter* proposes k tokens one at a time,
then one *verification* step runs the target model over all k at once and keeps the longest prefix it agrees with.
Self-speculation uses the model as its own drafter: no second model, no training. Tutorial 01 wrote this loop out
by hand; here the engine runs it. This script shows that it only pays when the drafts are cheaper than plain steps
and the verification is not much dearer, and that greedy speculation never changes the output.

Every run decodes the prompt in `_common.PROMPT` (notes about a bakery and a question: 247 tokens with the chat
template) greedily, 64 new tokens, with the embedded SmolLM2-135M, after a short warm-up run. Step times are
medians over each run's steps. The numbers quoted below come from one default run on a 2-core cloud VM shared with
other jobs; yours will differ (by 2x or more on a loaded machine), the shape of the result should not.

1. Plain decoding: one model step per token. 64 tokens in 64 steps (8.5 s; the median step 114 ms), and the start
   of the answer ('To solve this problem, we need to break it down ...').

2. Self-drafting with full attention (method='full', k = 8). 64 tokens in 64 steps, 8.0 of 8.0 drafts accepted per
   verification: the drafter IS the target, so it is never wrong. But k drafts plus the verification make k + 1
   tokens in k + 1 steps, one token per step, and every draft step reads the same weights and the same whole KV
   cache as a plain step. Nothing is saved.

3. A cheap drafter: StreamingLLM (method='streaming', budget 16 positions). Each draft attends to 4 "sink" tokens
   at the start, the 12 most recent verified positions and the drafts written since the last verification, out of
   ~279 positions. Result: 64 tokens in 197 steps, 22 verifications, 1.86 of 7.9 drafts accepted on average (2.86
   tokens per verification). Acceptance by draft position j, two ways: the share of verifications that accepted at
   least j drafts (the engine's `acceptance_by_position`; drafts are accepted as a prefix, so it only falls: 0.64
   for j = 1 to 0.10 for j = 8), and the chance that draft j is accepted once the drafts before it were (their
   ratio: 0.64, 0.57, 0.50, then 0.7-1.0: a cycle that gets past the first few drafts tends to run on; few cycles
   reach those positions). The first verification cycles, as printed:
       cycle  accepted  accepted drafts                          verifier token
           1         8  ' solve this problem, we need to break'  ' it'
           3         1  ','                                      ' we'
   A cycle that accepts all k drafts ends with a free *bonus* token; any other ends with the target's *correction*.

4. The greedy-equality check. The three outputs are printed side by side and compared: "identical token for token:
   True" (the script stops with an error otherwise). Why: a draft is kept only if it equals the target's argmax at
   its position, and the first mismatch is replaced by that argmax; by induction every token is the one plain
   greedy decoding writes. With sampling, rejection sampling keeps the *distribution* identical (exercise 2).
   The induction needs the verification's logits for a position to be, bit for bit, the decode step's. In
   bfloat16 two kernels rarely agree to the last bit: the script multiplies 9 rows by the down projection's shape
   (1,536 -> 576) one at a time and together, with torch's matmul (on this CPU 2 of 5,184 outputs differ in the
   last place) and with `batch_invariant.linear` (none differs). A last-place difference matters at a near-tie: at
   logits near 12, neighbouring bfloat16 values lie 0.0625 apart, so one flipped bit can swap the top two tokens,
   and from there the texts part. The engine computes a verification row with a decode row's arithmetic
   (`batch_invariant.py`; attention in fixed chunks of positions), so the equality holds in bfloat16 too. The GPU's
   compiled paged attention (`--compile`) keeps it only with `--exact`: otherwise its kernel visits the blocks a
   whole row sees on a second code path, after the others, and how many chunks a context is cut into depends on
   the batch; both change a row's last bits (BENCHMARKS.md, parity: 1 of 30 texts identical against 30 of 30).

5. What a cycle costs, three ways. A cycle of k drafts and one verification writes (accepted + 1) tokens, so
   speculation runs at (accepted + 1) x plain / (k x draft + verification) of plain decoding's speed.
   - This CPU, with the medians measured above: plain 114 ms, a streaming draft 84 ms (0.74x), a verification
     205 ms (1.8x). A cycle of 8 drafts and a verification costs 879 ms for 2.86 tokens: 0.37x plain by these step
     costs, and over the runs streaming took 21.0 s against plain's 8.5 s (0.40x). At ~280 positions the weights
     are most of a CPU step: a draft saves only the attention it skips, and every rejected draft is a step spent
     for no token, so speculation loses here.
   - The roofline model of tutorial 00 (`_roofline.py`), Qwen3-8B on an H200, batch 32 at 32K context: plain 39.5
     ms, a draft over 5% of the KV 5.3 ms, a verification of 9 tokens per request 39.5 ms, 1x a plain step (still
     memory-bound). By this model streaming drafts would run at 1.38x plain, full drafts at 1.00x.
   - What an H200 measures (BENCHMARKS.md), with the roofline's verification/plain ratio beside the measured one:
       H200 shape (BENCHMARKS.md)  plain ms  verify/plain: model  measured  draft/plain  accepted  lock-step
       SmolLM2-135M, 128 x 2,048       3.97                 1.0x      6.4x        0.77x      5.27      0.50x
       SmolLM2-135M, 512 x 4,096      15.85                 1.0x      3.8x        0.29x         6      1.15x
       SmolLM2-135M, 1,024 x 4,096    30.36                 1.0x      3.9x        0.19x         6      1.28x
       Qwen3-8B shape, 64 x 8,000     27.53                 1.0x      3.9x        0.36x         6      1.05x
     (and the balanced and ceiling columns of tutorials 04 and 07). A verification costs 3.8-6.4x a plain step,
     not 1x. The model leaves out the verification's PillarAttn score pass (every layer's keys gathered and read
     again, then a top-k), a step's fixed cost that bytes do not count (launches,
     small GEMMs, LM head, sampling: 2.7 of a 4.0 ms plain step of the small model), gathers of scattered positions,
     plain decoding reaching only 28-52% of the bandwidth, and slots left idle by stalls and the batch's tail.
   On the H200 SparseSpec does not pay today (a verification costs 3.8-6.4x a plain step; full SparseSpec runs at
   0.23x plain at 128 x 2,048); on one CPU thread at long contexts it does (pillar-lookup with balanced batching:
   1.41x plain at 8 x 4,096).

Plot: tutorials/out/02_acceptance_by_position.png, both acceptance curves against j.

With --quick the same steps run on a tiny random model (16 tokens, k = 4): acceptance is meaningless there, the
equality check is not.

Next: tutorial 03 lets the model choose the positions its drafts attend to.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import statistics
import time

import torch
import torch.nn.functional as F

from nano_sparsespec import SamplingParams, batch_invariant

from tutorials._common import PROMPT, StepLog, load_llm, parser, save_plot, section, start, table, with_spec
from tutorials._roofline import MEASURED_HEADERS, MODEL_LEAVES_OUT, PAYS_TODAY, measured_rows, step_ms


def generate(llm, ids, params, **spec):
    """Run one request with these speculation settings; returns (output, stats, seconds, commits, step ms), where
    step ms maps a step's kind ('D' draft, 'V' verification or plain decode) to the median of its durations."""
    commits, log = [], StepLog()                                  # commits: (new tokens, how many were drafts)
    with_spec(llm, **spec)
    t0 = time.perf_counter()
    out = llm.generate(None, params, prompt_token_ids=[ids], on_step=log.record,
                       on_commit=lambda seq, tokens, accepted: commits.append((tokens, accepted)))[0]
    seconds = time.perf_counter() - t0
    kinds = {}
    for step, duration in zip(log.steps[1:], log.durations()[1:]):   # the prefill step is left out
        kinds.setdefault(step.actions.get(0, "?"), []).append(1e3 * duration)
    return out, llm.last_stats, seconds, commits, {kind: statistics.median(d) for kind, d in kinds.items()}


def shorten(text: str, width: int = 40) -> str:
    text = repr(text)
    return text if len(text) <= width else text[:width - 4] + "...'"


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 02: naive self-speculative decoding")
    llm = load_llm(args)
    ids = llm.encode(PROMPT)
    new_tokens, k = (16, 4) if args.quick else (64, 8)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    print(f"prompt: {len(ids)} tokens; {new_tokens} new tokens, greedy")

    generate(llm, ids, SamplingParams(max_new_tokens=4, ignore_eos=True), method="full", stride=2)   # warm-up

    section("1. Plain decoding: one model step per token")
    plain, stats, plain_secs, _, plain_ms = generate(llm, ids, params, method="plain")
    print(f"{len(plain.token_ids)} tokens in {stats.steps} steps, {plain_secs:.1f} s; a step takes "
          f"{plain_ms['V']:.0f} ms (median)")
    print(f"text: {plain.text[:160]!r}...")

    section(f"2. Self-drafting with full attention (method='full', k={k})")
    full, stats, secs, _, full_ms = generate(llm, ids, params, method="full", stride=k)
    s = stats.summary(k)
    print(f"{len(full.token_ids)} tokens in {stats.steps} steps, {secs:.1f} s; accepted {s['mean_accepted']} of "
          f"{s['mean_offered']} drafts per verification; median step: draft {full_ms['D']:.0f} ms, verification "
          f"{full_ms['V']:.0f} ms")
    print(f"Every draft is accepted: the drafter IS the target model. But {k} draft steps and 1 verification step "
          f"make {k + 1} tokens: one token per step ({stats.steps} steps for {len(full.token_ids)} tokens), plain "
          "decoding's rate, and every one of those steps reads all the weights and the whole KV cache, like a plain "
          "step. Nothing is saved.")

    budget = 8 if args.quick else 16
    section(f"3. A cheap drafter: StreamingLLM window (method='streaming', k={k}, budget {budget} positions)")
    stream, stream_stats, secs, commits, stream_ms = generate(llm, ids, params, method="streaming", stride=k,
                                                              min_budget=budget, budget_ratio=0.01)
    s = stream_stats.summary(k)
    print(f"each draft attends to {min(llm.spec.sink_tokens, budget)} sink tokens + the most recent "
          f"{budget - min(llm.spec.sink_tokens, budget)} verified positions + the drafts since the last verification, "
          f"out of ~{len(ids) + new_tokens // 2} positions")
    print(f"{len(stream.token_ids)} tokens in {stream_stats.steps} steps, {secs:.1f} s; {s['verifications']} "
          f"verifications, accepted {s['mean_accepted']} of {s['mean_offered']} drafts on average "
          f"({s['tokens_per_verification']} tokens per verification)")
    print("acceptance by draft position j: the share of verifications that accepted at least j drafts (drafts are "
          "accepted as a prefix, so it can only fall), and the chance that draft j is accepted once the drafts "
          "before it were:")
    at_least = [r for r in s["acceptance_by_position"] if r is not None]
    given = [r / prev if prev else float("nan") for r, prev in zip(at_least, [1.0] + at_least)]
    table(["j", "P(at least j accepted)", "P(draft j | drafts before it)"],
          [[j + 1, a, "-" if g != g else g] for j, (a, g) in enumerate(zip(at_least, given))])   # nan: never reached
    print("the first verification cycles (accepted drafts | the verifier's own token):")
    rows = []
    for n, (tokens, accepted) in enumerate(commits[1:7], 1):   # commits[0] is the first token, made by the prefill
        rows.append([n, accepted, shorten(llm.decode(tokens[:accepted])), shorten(llm.decode(tokens[accepted:]))])
    table(["cycle", "accepted", "accepted drafts", "verifier token"], rows)

    section("4. The greedy-equality check")
    print(f"plain     : {plain.token_ids[:12]}...")
    print(f"full      : {full.token_ids[:12]}...")
    print(f"streaming : {stream.token_ids[:12]}...")
    same = plain.token_ids == full.token_ids == stream.token_ids
    print(f"identical token for token: {same}")
    print("Why: verification runs the target with full attention over the drafts and keeps a draft only if it IS the "
          "target's argmax at that position; the first mismatch is replaced by that argmax. By induction every emitted "
          "token is the one plain greedy decoding would have emitted.")
    if not same:
        raise SystemExit("greedy speculation changed the output: this is a bug")
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()              # the down projection's shape
    rows = torch.randn(9, 1536, generator=g).bfloat16()                           # a verification's 9 rows
    for name, linear in (("torch's matmul", F.linear), ("batch_invariant.linear", batch_invariant.linear)):
        alone = torch.cat([linear(row[None], weight) for row in rows])              # each row in a call of 1
        differ = int((alone != linear(rows, weight)).sum())
        print(f"bfloat16, each row alone vs the 9 rows together, {name}: {differ} of {alone.numel()} outputs differ")
    near = torch.tensor([12.375, 12.4375]).bfloat16()
    print(f"a near-tie: logits {near.tolist()} are neighbouring bfloat16 values; one last-place change swaps the "
          "argmax, and the texts part from that token on. The engine computes a verification row with the decode "
          "row's arithmetic (batch_invariant.py; compiled on a GPU: --exact), so greedy equality holds in bfloat16 "
          "too.")

    section("5. What a cycle costs: this CPU, the roofline model of an H200, and what an H200 measures")
    tokens = s["tokens_per_verification"]
    cpu_cycle = k * stream_ms["D"] + stream_ms["V"]
    print(f"On this CPU (median steps): plain {plain_ms['V']:.0f} ms, streaming draft {stream_ms['D']:.0f} ms "
          f"({stream_ms['D'] / plain_ms['V']:.2f}x plain), verification {stream_ms['V']:.0f} ms "
          f"({stream_ms['V'] / plain_ms['V']:.1f}x). A cycle of {k} drafts + 1 verification costs {cpu_cycle:.0f} ms "
          f"for {tokens} tokens: {tokens * plain_ms['V'] / cpu_cycle:.2f}x plain by these step costs; measured over "
          f"the runs, streaming took {secs:.1f} s against plain's {plain_secs:.1f} s ({plain_secs / secs:.2f}x).")
    verdict = "loses" if secs > 1.1 * plain_secs else "wins" if plain_secs > 1.1 * secs else "breaks about even"
    print(f"At ~{len(ids) + new_tokens // 2} positions the weights are most of a CPU step, so a draft saves only the "
          "attention it skips, and each rejected draft is a step spent for no token: at this context speculation "
          f"{verdict} here (a shared machine moves these timings by "
          "2x). On one CPU thread at 4,096 positions, where attention is most of a plain step, it wins (1.41x in "
          "BENCHMARKS.md).")
    batch, context = 32, 32768
    plain_gpu = step_ms(batch, batch * context, batch * context)
    sparse = int(0.05 * context) + k // 2                     # 5% critical positions + the drafts' recent window
    draft_gpu = step_ms(batch, batch * sparse, batch * sparse)
    verify_gpu = step_ms(batch * (k + 1), batch * context, batch * (k + 1) * context)
    print(f"\nThe roofline model (tutorial 00), Qwen3-8B on an H200, batch {batch} at {context} context: plain "
          f"{plain_gpu:.1f} ms, a draft over 5% of the KV {draft_gpu:.1f} ms ({draft_gpu / plain_gpu:.2f}x), a "
          f"verification of {k + 1} tokens per request {verify_gpu:.1f} ms ({verify_gpu / plain_gpu:.1f}x: still "
          "memory-bound, as cheap as a plain step).")
    rows = []
    for name, cost, n in (("full", plain_gpu, k + 1), ("streaming", draft_gpu, tokens)):
        cycle = k * cost + verify_gpu
        rows.append([name, round(n, 2), round(cycle, 1), f"{n * plain_gpu / cycle:.2f}x"])
    table(["drafter", "tokens per cycle", "cycle ms", "modelled speed-up"], rows)
    print("\nMeasured on an H200 (BENCHMARKS.md; a verification is NOT a plain step's cost):")
    table(MEASURED_HEADERS, measured_rows(8))
    print("lock-step = (a + 1) x plain / (k x draft + verification); balanced and ceiling: tutorial 04 and 07. "
          + MODEL_LEAVES_OUT)
    print(PAYS_TODAY)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = list(range(1, len(at_least) + 1))
        ax.plot(x, at_least, marker="o", label="P(at least j drafts accepted)")
        ax.plot(x, given, marker="s", label="P(draft j accepted | drafts before it accepted)")
        ax.set(xlabel="draft position j", ylabel="probability", ylim=(0, 1.05),
               title=f"StreamingLLM drafts, budget {budget}, k = {k}")
        ax.legend(fontsize=8)

    save_plot(args, "02_acceptance_by_position", draw)


if __name__ == "__main__":
    main()
