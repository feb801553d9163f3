"""Collect the drafter ablation's acceptance records (the *.json files beside this script) into the tables of README.md.

    python benchmarks/drafter/summarize.py            # prints markdown

Per setting (greedy looping text, greedy with repeated 6-grams banned, T = 0.6) and drafter: mean accepted drafts of
8 and the same by context length at the verification. It also checks that every greedy run of a setting produced
the same tokens as every other (across files too): the drafters are lossless, so they must.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def setting(record: dict, row: dict) -> str:
    if row["temperature"] > 0:
        return f"T={row['temperature']:g}"
    return "T=0, repeated 6-grams banned" if record["args"].get("no_repeat_ngram") else "T=0 (looping text)"


def main() -> None:
    rows: dict[str, dict[str, dict]] = {}                 # setting -> label -> row (the first file that has it)
    sources: dict[tuple[str, str], str] = {}
    for path in sorted(HERE.glob("[a-f]_*.json")):      # session 2's ablation (phase D's files have their own tables)
        record = json.loads(path.read_text())
        for row in record["rows"]:
            s = setting(record, row)
            if row["label"] not in rows.setdefault(s, {}):
                rows[s][row["label"]] = row
                sources[s, row["label"]] = path.name
    for s, by_label in rows.items():
        first = next(iter(by_label.values()))
        buckets = [b["bucket"] for b in first["by_context"]]
        print(f"\n### {s}\n")
        print("| drafter | accepted of 8 | " + " | ".join(f"ctx {b}" for b in buckets) + " | rep4 | run32 | file |")
        print("|---|---:|" + "---:|" * len(buckets) + "---:|---:|---|")
        for label, row in sorted(by_label.items(), key=lambda kv: -kv[1]["mean_accepted"]):
            cells = [f"{b['mean_accepted']:.2f}" if b["mean_accepted"] is not None else "–"
                     for b in row["by_context"]]
            print(f"| {label} | **{row['mean_accepted']:.2f}** | " + " | ".join(cells)
                  + f" | {row['rep4']:.0%} | {row['run32']:.0%} | {sources[s, label]} |")
        if first["temperature"] == 0:
            outputs = {label: [r["token_ids"] for r in row["requests"]] for label, row in by_label.items()}
            same = all(o == outputs[first["label"]] for o in outputs.values())
            print(f"\nall {len(outputs)} greedy drafters produced identical tokens: {same}")


if __name__ == "__main__":
    main()
