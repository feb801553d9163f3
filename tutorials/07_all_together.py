"""Tutorial 07: all together, the generate CLI and the benchmark, and how to run on a GPU and a real Qwen3.

    python -m tutorials.07_all_together            # about two minutes on a laptop CPU
    python -m tutorials.07_all_together --quick    # seconds, tiny random model
    python tutorials/07_all_together.py --quick    # the same, run as a file

The previous tutorials took SparseSpec apart; this one runs it the way a user does, through the two command-line
tools, and says how to read their numbers and where to run them for real. Numbers from one default run on a shared
2-core cloud VM (the embedded SmolLM2-135M, one CPU thread):

1. The generate CLI: one prompt, streamed.
       $ python -m nano_sparsespec.generate --prompt 'What is the sum of the first 10 odd numbers? ...'
           --method pillar --stride 8 --min-budget 16 --async --max-new-tokens 48
   prints the answer as it is written, then on stderr the summary, e.g. "48 tokens in 7.08 s: 6.8 tok/s; 5.57 of
   8.00 drafts accepted per verification": the whole run's throughput and the mean accepted drafts out of those
   offered (k, fewer near the end). --show-drafts colours accepted drafts and the verifier's own tokens;
   --method plain is the baseline.

2. The same with --json: text, token ids and stats per request, plus the run's stats. The script prints each stats
   field next to its meaning: output_tokens, tokens_per_second, steps (forward passes), verifications (with at least
   one draft), mean_accepted, tokens_per_verification (= mean_accepted + 1), accepted_histogram (how many
   verifications accepted 0..k drafts) and acceptance_by_position (entry j: the share of the verifications that
   offered draft j + 1 which accepted at least j + 1 drafts; unconditional, so it falls with j).
   Skipped with --quick.

3. The benchmark, `python -m nano_sparsespec.tools.bench`: the same requests through each row, one SparseSpec piece
   added at a time (plain; pillar-naive; +balanced; +async, which also bounds the KV pool), here 4 requests, 24 tokens,
   k = 4. It prints a markdown table; in the quoted run:
       | row          | tok/s | vs plain | accepted / k | GB/s | ... | steps | offloads / restores | = plain |
       | plain        |  19.3 |    1.00x | -            | 2.68 | ... |    24 | -                   |     4/4 |
       | pillar-naive |  14.6 |    0.75x | 2.75 / 4     | 2.57 | ... |    31 | -                   |     4/4 |
       | +async       |   9.6 |    0.50x | 2.75 / 4     | 2.71 | ... |    50 | 1 / 1               |     4/4 |
   How to read it: 'vs plain' is the speed-up on the same requests; 'accepted / k' bounds it (a cycle of k drafts
   and a verification writes accepted + 1 tokens); 'GB/s' is the bytes the row had to read by the byte model of
   tutorial 00 over its seconds, and '% of peak BW' its share of the roofline; '= plain' counts requests identical to
   the plain row (greedy: all). On this CPU, with a small model at short context, every step is bound by the
   weights and per-step overheads, so speculation loses here, as tutorial 02 measures. It pays on one CPU thread at
   long contexts (pillar-lookup with balanced batching: 1.41x plain at 8 x 4,096 in BENCHMARKS.md).

4. On a GPU: the same commands with --device cuda --dtype bfloat16, plus --cuda-graphs --compile (the fast GPU
   path: compiled kernels, each decode step replayed as one CUDA graph; --exact keeps greedy bfloat16 output
   bit-identical to plain decoding's, for plain steps ~20% slower); a bench run at batch 64 and 2048 new
   tokens; and `--profile-steps`, which times one plain, one draft and one verification step at given batch x
   context shapes and prints the ceiling there: (accepted + 1) / (k + 1) x a plain step over a plain step with next
   to nothing to attend to. Below 1x, no drafter that runs the model's layers can pay at that shape (the embedded
   model on an H200 at 2,048 positions: ~1.0x; a Qwen3-8B shape at 8,000: 2.55x). The script prints the step costs
   an H200 measured (BENCHMARKS.md): a verification costs 3.8-6.4x a plain step where the roofline model says ~1x,
   and the lock-step and balanced cycles built from them reach 0.37-1.25x plain. It names what the model leaves out
   (the verification's score pass, a step's fixed cost, gathers, the bandwidth actually reached, idle slots) and
   where SparseSpec pays today: not on the H200 (full SparseSpec 0.23x plain at 128 x 2,048), but on one CPU thread
   at long contexts (1.41x at 8 x 4,096).

5. A real Qwen3 checkpoint: the package never downloads anything. Fetch one yourself (e.g. `huggingface-cli download
   Qwen/Qwen3-8B --local-dir /models/Qwen3-8B`) and pass --model /models/Qwen3-8B, or LLM('/models/Qwen3-8B', ...)
   from Python. The script prints what it needs: 16.4 GB of bf16 weights plus 144 KiB of KV per token, about
   0.85 M tokens of KV on an H200.

Plot: tutorials/out/07_verification_cost.png, a verification's cost in plain steps, modelled against measured.
With --quick the CLI and the benchmark run on a tiny random model (8 tokens; the bench with 2 requests).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib.util
import json
import os
import shlex
import subprocess

from tutorials._common import SHORT_PROMPTS, parser, save_plot, section, start, table, tiny_model_dir
from tutorials._roofline import (GB, H200, MEASURED_H200, MEASURED_HEADERS, MODEL_LEAVES_OUT, PAYS_TODAY, QWEN3_8B,
                                 kv_bytes_per_token, measured_rows, modelled_verify_ratio, weight_bytes_per_step)

STATS = {   # what the --json "stats" fields mean
    "output_tokens": "tokens written, all requests",
    "tokens_per_second": "output tokens / wall seconds of the engine loop (prefill included)",
    "steps": "model forward passes (each: one batch of prefill chunks, drafts and verifications)",
    "verifications": "verification steps that checked at least one draft",
    "mean_accepted": "drafts accepted per verification (out of k)",
    "tokens_per_verification": "mean_accepted + 1: the verifier always adds one token of its own",
    "accepted_histogram": "how many verifications accepted 0, 1, ..., k drafts",
    "acceptance_by_position": "entry j: share of verifications (offering draft j+1) that accepted >= j+1 drafts",
}


def run(command: list[str], threads: int) -> subprocess.CompletedProcess:
    """Run a command as a reader would type it; OMP_NUM_THREADS carries this tutorial's --threads."""
    print(f"$ {shlex.join(['python', *command[1:]])}")
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads > 0 else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(done.stdout, done.stderr, sep="\n")
        raise SystemExit(f"the command failed with exit code {done.returncode}")
    return done


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 07: all together")
    path = str(tiny_model_dir()) if args.quick else args.model
    model = [] if path is None else ["--model", path]
    new_tokens = 8 if args.quick else 48
    generate = [sys.executable, "-m", "nano_sparsespec.generate", *model, "--prompt", SHORT_PROMPTS[0],
                "--method", "pillar", "--stride", "8", "--min-budget", "16", "--async",
                "--max-new-tokens", str(new_tokens)]

    section("1. The generate CLI: one prompt, streamed")
    done = run(generate, args.threads)
    print(done.stdout.rstrip())
    print(f"[stderr] {done.stderr.strip().splitlines()[-1]}")
    print("The last line is the summary: tokens per second of the whole run, and drafts accepted per verification "
          "out of the drafts offered (k = 8, fewer near the end). --show-drafts colours accepted drafts green and the "
          "verifier's own tokens yellow; --method plain gives the baseline to compare with.")

    section("2. The same, machine-readable (--json)")
    if args.quick:
        print("skipped with --quick: the same command with --json prints text, token ids and these stats per request")
    else:
        done = run(generate + ["--json"], args.threads)
        stats = json.loads(done.stdout)["stats"]
        table(["field", "value", "meaning"], [[key, str(stats.get(key)), meaning] for key, meaning in STATS.items()])

    section("3. The benchmark: every piece switched on one at a time")
    if importlib.util.find_spec("nano_sparsespec.tools.bench") is None:
        print("python -m nano_sparsespec.tools.bench is not in this checkout yet.")
    else:
        batch, tokens, k = (2, 8, 4) if args.quick else (4, 24, 4)
        bench = [sys.executable, "-m", "nano_sparsespec.tools.bench", *model,
                 "--rows", "plain,pillar-naive,+balanced,+async", "--batch-size", str(batch),
                 "--max-new-tokens", str(tokens), "--ignore-eos", "--stride", str(k), "--min-budget", "16"]
        if args.threads > 0:
            bench += ["--threads", str(args.threads)]
        done = run(bench, args.threads)
        print(done.stdout.rstrip())
        print("How to read it: 'vs plain' is the speed-up over the plain row on the same requests; 'accepted / k' "
              "sets the ceiling (a cycle of k drafts + 1 verification writes accepted + 1 tokens); 'GB/s' is the "
              "bytes the byte model says the row had to read (weights once per step plus the KV each token attended "
              "to) over its seconds, and '% of peak BW' compares that with the roofline of tutorial 00; 'offloads / "
              "restores' appear for the rows that run in a bounded KV pool (+offload, +async); '= plain' counts the "
              "requests whose tokens are identical to the plain row's (greedy: all). On this CPU the small model's "
              "steps are bound by the weights and by per-step overheads, so speculation shows little or no gain: the "
              "numbers that matter come from a GPU at long context.")

    section("4. On a GPU")
    print("Install the CUDA build of torch first, then this package (pip install -e '.[embedded]'). Then:")
    for line in ("python -m nano_sparsespec.generate --device cuda --dtype bfloat16 --cuda-graphs --compile "
                 "--method pillar --async --prompt '...'",
                 "python -m nano_sparsespec.tools.bench --device cuda --dtype bfloat16 --cuda-graphs --compile "
                 "--batch-size 64 --max-new-tokens 2048 --ignore-eos",
                 "python -m nano_sparsespec.tools.bench --device cuda --profile-steps --profile-shapes 32x8k,64x32k"):
        print(f"  $ {line}")
    print("--cuda-graphs --compile is the fast GPU path: torch.compile'd kernels, and each decode step, padded to "
          "a bucket shape, is one upload of its index lists and one replay of a CUDA graph that builds the step's "
          "tensors, runs the model, samples and verifies (cuda_graphs.py); without them every kernel is launched "
          "from Python and the GPU mostly waits. A bucket's first step records its graph and torch.compile compiles "
          "for its batch class (the progress bar names each graph as it is recorded): for plain decoding at batch 512 "
          "on an H200 about 45 s before tokens flow, about 10 s when an earlier run's compile cache (kept under "
          ".cache/) is at hand. --async overlaps the host's bookkeeping with the "
          "device (tutorial 05); --kv-blocks bounds the device pool (tutorial 06). --profile-steps times one plain, "
          "draft, verification and mixed step at a shape; its 'ceiling' column is (accepted + 1) / (k + 1) x a plain "
          "step over a plain step with next to nothing to attend to (no step that runs the model's layers costs "
          "less); where attention is a small part of a plain step it is near or below 1x, and no drafter can pay "
          "there. What those profiles measured on an H200 (BENCHMARKS.md), next to the roofline model's 1x "
          "verification:")
    table(MEASURED_HEADERS, measured_rows(8))
    print(MODEL_LEAVES_OUT)
    print(PAYS_TODAY)

    section("5. A real Qwen3 checkpoint")
    weights = weight_bytes_per_step(QWEN3_8B, 2) + QWEN3_8B.vocab_size * QWEN3_8B.hidden_size * 2
    print("The package never downloads anything. Fetch a checkpoint yourself, e.g.")
    print("  $ huggingface-cli download Qwen/Qwen3-8B --local-dir /models/Qwen3-8B")
    print("  $ python -m nano_sparsespec.generate --model /models/Qwen3-8B --device cuda --dtype bfloat16 "
          "--method pillar --stride 8 --async --max-new-tokens 4096 --prompt 'Prove that sqrt(2) is irrational.'")
    print(f"Qwen3-8B needs {weights / GB:.1f} GB of bf16 weights plus {kv_bytes_per_token(QWEN3_8B, 2) // 1024} KiB "
          f"of KV per token: on an H200 ({H200[2] / GB:.0f} GB) about "
          f"{(H200[2] - weights) / kv_bytes_per_token(QWEN3_8B, 2) / 1e6:.2f} M tokens of KV. Any Qwen3 or "
          "Llama-family directory with config.json, *.safetensors and tokenizer files loads the same way; "
          "from Python: LLM('/models/Qwen3-8B', device='cuda', method='pillar', async_verify=True).")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.8))
        x, width = range(len(MEASURED_H200)), 0.38
        shapes = MEASURED_H200.values()
        ax.bar([i - width / 2 for i in x], [modelled_verify_ratio(cfg, b, c) for cfg, b, c, *_ in shapes], width,
               label="roofline model")
        ax.bar([i + width / 2 for i in x], [ms[2] / ms[0] for *_, ms, _ in shapes], width, label="measured on an H200")
        ax.set_xticks(list(x), [name.replace(", ", "\n") for name in MEASURED_H200], fontsize=8)
        ax.set(ylabel="verification / plain step", ylim=(0, 8.5),
               title="What a verification (k + 1 = 9 rows) costs, in plain steps")
        ax.legend(fontsize=8, loc="upper left")

    save_plot(args, "07_verification_cost", draw)


if __name__ == "__main__":
    main()
