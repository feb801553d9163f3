"""A bench row's device time modeled from step costs, to compare the policies that end a run (the catch-up's
finish quantile, the plain tail) on the host alone (no GPU, no model math).

The engine, scheduler and runner's host side run as in `count_graph_buckets.py` (its `BucketCounter`, with
requests accepting as differently as those of the H200 pillar-lookup row in `MEASURED_ROW`); each step is
charged what the H200 step profile gives a step of its kind and work: a fixed cost, plus per request a draft's,
a verification's or a plain decode's cost and its context's key reads (`step_ms`). Plain decoding is modeled in
lock-step waves, one token a request a step. The model leaves out the host, graph recording and everything the
profile does not see; it ranks policies, it does not predict a row's tokens a second.

    python benchmarks/tail_model.py BATCH REQUESTS TOKENS FINISH_QUANTILE [PLAIN_TAIL]
    python benchmarks/tail_model.py 1024 2048 4096 0.95
"""
import json
import statistics
import sys
from pathlib import Path

import count_graph_buckets as counted

# H200 step costs of the embedded model at batch 1,024 (fitted to the step profiles of 1f7b414 and 5baa36c):
# milliseconds a step, microseconds a request's work, nanoseconds a position of its context
PLAIN_FIXED_MS, PLAIN_ROW_US, POSITION_NS = 3.14, 0.586, 5.43
SPECULATIVE_FIXED_MS, DRAFT_US, CHECK_US, RESELECT_POSITION_NS = 4.1, 3.48, 10.9, 15.5
# the row whose requests' mean accepted counts (min, p10, median, p90, max) the made-up requests follow
MEASURED_ROW = Path(__file__).parent / "results" / "h200-1024x4096-lookup.json"


def measured_spread() -> tuple:
    """(quantile, mean accepted of 8) of the +async row's requests in `MEASURED_ROW`."""
    row = next(r for r in json.loads(MEASURED_ROW.read_text())["rows"] if r["name"] == "+async")
    by_request = row["accepted_by_request"]
    return tuple(zip((0.0, 0.1, 0.5, 0.9, 1.0), (by_request[q] for q in ("min", "p10", "median", "p90", "max"))))


def step_ms(plan) -> float:
    """Modeled milliseconds of a step: a speculative one (drafts, or a verification of drafts) or a plain one."""
    speculative = bool(plan.sparse) or any(w.kind == "verify" and w.num_tokens > 1 for w, _ in plan.dense)
    us = DRAFT_US * len(plan.sparse)
    for work, _ in plan.dense:
        context = work.start + work.num_tokens
        if work.kind == "prefill":
            us += PLAIN_ROW_US * work.num_tokens + POSITION_NS * context / 1e3
        elif speculative:     # a check (a plain-decoding request's too): k + 1 rows, maybe a re-selection
            us += CHECK_US + (POSITION_NS + RESELECT_POSITION_NS * work.reselects) * context / 1e3
        else:
            us += PLAIN_ROW_US + POSITION_NS * context / 1e3
    return (SPECULATIVE_FIXED_MS if speculative else PLAIN_FIXED_MS) + us / 1e3


class Costed(counted.BucketCounter):
    """`BucketCounter` that notes each step's modeled milliseconds and requests working."""
    steps = []                      # per step: (milliseconds, requests working)

    def _run(self, plan, shape, static):
        self.steps.append((step_ms(plan), len(plan.dense) + len(plan.sparse)))
        return super()._run(plan, shape, static)


def plain_ms(batch: int, requests: int, tokens: int, mean_prompt: float) -> float:
    """Plain decoding's modeled milliseconds: waves of `batch` requests in lock-step, a token a step."""
    waves = -(-requests // batch)
    return sum(waves * (PLAIN_FIXED_MS + batch * (PLAIN_ROW_US + POSITION_NS * (mean_prompt + t) / 1e3) / 1e3)
               for t in range(tokens))


def main() -> None:
    batch, requests, tokens = (int(x) for x in sys.argv[1:4])
    finish_quantile = float(sys.argv[4])
    plain_tail = float(sys.argv[5]) if len(sys.argv) > 5 else 0.125
    Costed.spread, counted.SPREAD = True, measured_spread()
    llm = counted.host_only_llm(Costed, method="pillar-lookup", batch_policy="balanced", max_batch=batch,
                                async_verify=True, refresh_every=6, finish_quantile=finish_quantile,
                                plain_tail=plain_tail)
    prompts, params = counted.workload(requests, tokens)
    llm.generate(None, params, prompt_token_ids=prompts)
    modeled = sum(ms for ms, _ in Costed.steps)
    plain = plain_ms(batch, requests, tokens, statistics.mean(len(p) for p in prompts))
    print(f"finish quantile {finish_quantile}, plain tail {plain_tail}, batch {batch}, {requests} requests x "
          f"{tokens} tokens: {len(Costed.steps)} steps, modeled {modeled / 1e3:.1f} s, plain {plain / 1e3:.1f} s, "
          f"ratio {plain / modeled:.3f}; mean accepted {statistics.mean(llm.last_stats.accepted_counts):.2f}")
    tenth = len(Costed.steps) // 10
    tenths = [Costed.steps[i * tenth:(i + 1) * tenth] for i in range(10)]
    print("  time by tenth " + " ".join(f"{sum(ms for ms, _ in t) / modeled:.3f}" for t in tenths))
    print("  busy by tenth " + " ".join(f"{statistics.mean(n for _, n in t) / batch:.2f}" for t in tenths))


if __name__ == "__main__":
    main()
