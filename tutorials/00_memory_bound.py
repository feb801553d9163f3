"""Tutorial 00: why decoding is memory-bound.

    python -m tutorials.00_memory_bound            # about a minute on a laptop CPU
    python -m tutorials.00_memory_bound --quick    # seconds, tiny random model
    python tutorials/00_memory_bound.py --quick    # the same, run as a file

A decode step turns one new token per request into logits. To do it, the step must read every weight of the model
once (whatever the batch size) and, for every request, the K and V of every position it attends to. This script
counts those bytes, turns them into the fastest possible step time (the roofline), and times real steps on your CPU.
Numbers quoted below come from one default run on a shared 2-core cloud VM; timings move with the machine's load.

1. Bytes one decode step reads: Qwen3-8B in bf16. The step reads 15.14 GB of weights: every matrix of the 36 layers
   and the LM head; the input embedding table is only indexed, one row per token. The KV cache costs 144 KiB per
   token of context (2 for K and V x 36 layers x 8 KV heads x 128 x 2 bytes): one request at 32K context holds
   4.83 GB. The table crosses batch (1, 8, 32, 128) with context (1K, 8K, 32K); three of its rows:
       batch  context  weights GB  KV GB  KV share  FLOP/byte  H100 ms  H200 ms  H200 tok/s  fits 141GB
           1    1,024        15.1    0.2        1%          1     4.56     3.56         281  yes
          32    1,024        15.1    4.8       24%       25.2     5.96     4.64       6,891  yes
          32   32,768        15.1    155       91%        6.5     50.7     39.5         811  no
   At batch 1 the weights dominate and a step costs ~3.6 ms on an H200 whatever the context. Batching shares the
   weights among requests (tokens/s grows almost linearly with the batch at 1K context), but the KV grows with
   batch x context: at batch 32 and 32K context 91% of the bytes are KV, and throughput drops from 6,891 to 811
   tokens/s (the row does not even fit in 141 GB: tutorial 06). FLOP/byte is the arithmetic intensity; an H100 or
   H200 is compute-bound only above ~295 or ~230. Each request's K/V serve only its own query heads (4 per KV head
   in Qwen3-8B: 4 FLOP per byte), so batching never raises the KV's intensity: at long context every step is
   memory-bound. The last line previews SparseSpec: a draft step that attends to 5% of the context reads 23 GB
   instead of 170 GB (5.3 ms instead of 39.5 on an H200). That is the model; measured on an H200 (tutorial 02), a
   Qwen3-8B-shape draft costs 0.31x a plain step and a verification, which the model prices like a plain step,
   6.5x.

2. The roofline of this CPU. A 512 MiB torch copy measures the bandwidth one thread gets (17.7 GB/s in the quoted
   run, counting the read and the write) and a 1024x1024 float32 matmul its arithmetic (67 GFLOP/s). The ridge
   point, ~3.8 FLOP/byte, says a CPU core is far more balanced than a GPU; an H200 moves ~240x more bytes and does
   ~15,000x more FLOPs per second.

3. Measured decode steps on this CPU. The embedded SmolLM2-135M in float32 reads 538 MB of weights per step and
   45 KiB of KV per token. For each (batch, context) the script runs plain decoding through the real engine on
   random prompt tokens and times the steps in which every request decodes (`StepLog`). After one warm-up run it
   runs every shape 3 times, the shapes interleaved so that a burst of load from another job spreads over all of
   them, and reports the median step (the first decode step of each run left out). In a run on the same VM under
   heavy load from other jobs (its copy bandwidth measured 6.6 GB/s, so the roofline column is higher):
       batch  context  KV MB  roofline ms  measured ms  measured/roofline
           1       64    2.9         82.4          109                1.3
           1      512   23.6         85.5          116                1.4
           1    2,048   94.4         96.3          149                1.5
          16      256    189          111          361                3.3
   The roofline is max(bytes / copy bandwidth, FLOPs / matmul speed). A real step here is slower than that: one
   CPU thread also pays for Python, for dozens of small kernels per layer and for attention in plain torch. The
   trends are the lesson. At batch 1, context 64 -> 2048 makes the step 1.4x slower with the same weights; at
   batch 16 a token costs 23 ms against 109 at batch 1, because the weights are read once per step. A single
   timed step can mislead on a shared machine (one earlier version, timing a handful of steps without warm-up,
   once measured context 512 slower than context 2,048): that is why the script warms up and takes medians.

With matplotlib installed it also saves tutorials/out/00_roofline.png: the H200 tokens/s bound against context for
batch 1 to 128, drawn only where the weights and the KV fit in 141 GB. With --quick the Qwen3-8B tables are the same
and section 3 times a tiny random model instead.

Next: tutorial 02 lets the model draft for itself.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import statistics
import time

import torch

from nano_sparsespec import SamplingParams

from tutorials._common import StepLog, load_llm, parser, random_prompt, save_plot, section, start, table, with_spec
from tutorials._roofline import (GB, GPUS, QWEN3_8B, flops_per_step, kv_bytes_per_token, roofline_ms,
                                 weight_bytes_per_step)

# ----------------------------------------------------------------------------------------------------------------------
# this machine

def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of one large torch copy (each element is read once and written once), best of `repeats`."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.zeros_like(src)            # touch every page first: the first write to fresh memory is slow
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def matmul_flops(n: int, repeats: int) -> float:
    """FLOP/s of a float32 n x n matmul (the dtype the tutorials run on the CPU), best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def decode_step_ms(llm, batch: int, context: int, new_tokens: int) -> list[float]:
    """Milliseconds of the engine's pure decode steps (every request decoding) for `batch` prompts of `context`; the
    first decode step after the prefill is left out (a warm-up: it touches the freshly written KV)."""
    vocab = llm.model.config.vocab_size
    prompts = [random_prompt(context, vocab, seed=i) for i in range(batch)]
    with_spec(llm, method="plain", prefill_chunk=batch * context)        # prefill everything in one step
    log = StepLog()
    llm.generate(None, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), prompt_token_ids=prompts,
                 on_step=log.record)
    decode = [d for s, d in zip(log.steps, log.durations()) if set(s.actions.values()) == {"V"}]
    return [1e3 * d for d in decode[1:]]


def measure_decode_ms(llm, grid, new_tokens: int, repeats: int) -> dict[tuple[int, int], float]:
    """(batch, context) -> median ms of a decode step. One warm-up run first; then `repeats` rounds over the whole
    grid, so that a burst of load from another process on a shared machine spreads over every shape instead of
    landing on one; the median of all of a shape's steps."""
    decode_step_ms(llm, *grid[0], new_tokens)                              # warm-up: first-call costs
    steps = {shape: [] for shape in grid}
    for _ in range(repeats):
        for shape in grid:
            steps[shape] += decode_step_ms(llm, *shape, new_tokens)
    return {shape: statistics.median(ms) for shape, ms in steps.items()}


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 00: why decoding is memory-bound")

    section("1. Bytes one decode step reads: Qwen3-8B in bf16")
    cfg = QWEN3_8B
    w_bytes, kv_token = weight_bytes_per_step(cfg, 2), kv_bytes_per_token(cfg, 2)
    print(f"weights read per step: {w_bytes / GB:.2f} GB (the input embedding table is not read, only its rows)")
    print(f"KV cache per token of context: {kv_token / 1024:.0f} KiB "
          f"(2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} x 2 bytes)")
    print(f"a request at 32K context holds {32768 * kv_token / GB:.2f} GB of KV: "
          f"{32768 * kv_token / w_bytes:.2f}x the weights")
    bw, peak, mem = GPUS["H200 (measured)"]
    resident = w_bytes + cfg.vocab_size * cfg.hidden_size * 2     # what must fit in memory: + the embedding table
    rows = []
    for batch in (1, 8, 32, 128):
        for context in (1024, 8192, 32768):
            kv = batch * context * kv_token
            flops = flops_per_step(cfg, batch, batch * context, w_bytes // 2)
            h100 = roofline_ms(w_bytes + kv, flops, *GPUS["H100 SXM"][:2])
            h200 = roofline_ms(w_bytes + kv, flops, bw, peak)
            fits = "yes" if resident + kv <= mem else "no"
            rows.append([batch, context, round(w_bytes / GB, 1), round(kv / GB, 1), f"{kv / (w_bytes + kv):.0%}",
                         round(flops / (w_bytes + kv), 1), round(h100, 2), round(h200, 2),
                         round(batch / h200 * 1e3), fits])
    table(["batch", "context", "weights GB", "KV GB", "KV share", "FLOP/byte", "H100 ms", "H200 ms", "H200 tok/s",
           "fits 141GB"], rows)
    group = cfg.num_heads // cfg.num_kv_heads
    print(f"FLOP/byte is the step's arithmetic intensity; a GPU is compute-bound only above its ridge point, peak / "
          f"bandwidth: H100 {989e12 / 3.35e12:.0f}, H200 {989e12 / 4.3e12:.0f} FLOP/byte. Batching raises the "
          f"intensity of the weights (every request's token uses them), never of the KV: a request's K/V serve only "
          f"its own query, {group} query heads per KV head = {group} FLOP/byte. So at long context every step is "
          f"memory-bound, at any batch size.")
    batch, context = 32, 32768
    kv, sparse_kv = batch * context * kv_token, batch * max(128, context // 20) * kv_token
    print(f"SparseSpec preview, batch {batch} at {context} context on an H200: a plain step reads "
          f"{(w_bytes + kv) / GB:.0f} GB ({1e3 * (w_bytes + kv) / bw:.1f} ms); a draft step that attends to 5% of the "
          f"context reads {(w_bytes + sparse_kv) / GB:.0f} GB ({1e3 * (w_bytes + sparse_kv) / bw:.1f} ms). A model, "
          "not a measurement: measured on an H200 a Qwen3-8B-shape draft costs 0.31x a plain step and a "
          "verification 6.5x (tutorial 02).")

    section("2. The roofline of this CPU")
    mib, n = (64, 256) if args.quick else (512, 1024)
    cpu_bw, cpu_flops = copy_bandwidth(mib, 3 if args.quick else 5), matmul_flops(n, 3)
    print(f"copy bandwidth ({mib} MiB torch copy, read + write): {cpu_bw / GB:.1f} GB/s")
    print(f"float32 matmul ({n}x{n}): {cpu_flops / 1e9:.0f} GFLOP/s")
    print(f"ridge point: {cpu_flops / cpu_bw:.1f} FLOP/byte (H200: {989e12 / 4.3e12:.0f}); an H200 moves "
          f"{4.3e12 / cpu_bw:.0f}x more bytes and does {989e12 / cpu_flops:.0f}x more FLOPs per second")

    section("3. Measured decode steps on this CPU")
    llm = load_llm(args)
    model_cfg, itemsize = llm.model.config, llm.model.embed_tokens.weight.element_size()
    m_bytes, m_kv = weight_bytes_per_step(model_cfg, itemsize), kv_bytes_per_token(model_cfg, itemsize)
    print(f"weights read per step: {m_bytes / 1e6:.0f} MB; KV per token: {m_kv / 1024:.1f} KiB")
    new_tokens, repeats = (4, 2) if args.quick else (6, 3)
    grid = ([(1, 32), (1, 256), (4, 32)] if args.quick else
            [(1, 64), (1, 512), (1, 2048), (4, 256), (16, 256)])
    timed = measure_decode_ms(llm, grid, new_tokens, repeats)
    print(f"each shape: the median of its decode steps over {repeats} runs, interleaved with the other shapes', "
          f"after a warm-up run")
    rows, measured = [], []
    for (batch, context), ms in timed.items():
        kv = batch * context * m_kv
        bound = roofline_ms(m_bytes + kv, flops_per_step(model_cfg, batch, batch * context, m_bytes // itemsize),
                            cpu_bw, cpu_flops)
        measured.append((batch, context, ms, bound))
        rows.append([batch, context, round(kv / 1e6, 1), round(bound, 1), round(ms, 1), round(ms / bound, 1)])
    table(["batch", "context", "KV MB", "roofline ms", "measured ms", "measured/roofline"], rows)
    alone = [m for m in measured if m[0] == 1]
    widest = max(measured, key=lambda m: m[0])
    print(f"batch 1, context {alone[0][1]} -> {alone[-1][1]}: the step gets {alone[-1][2] / alone[0][2]:.1f}x slower "
          f"(same weights, more KV to read)")
    print(f"batch {widest[0]}: {widest[2] / widest[0]:.1f} ms per token, against {alone[0][2]:.1f} at batch 1 "
          f"(the weights are read once for the whole batch)")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for batch in (1, 8, 32, 128):
            contexts = [c * 1024 for c in (1, 2, 4, 8, 16, 32, 64) if resident + batch * c * 1024 * kv_token <= mem]
            ms = [roofline_ms(w_bytes + batch * c * kv_token, flops_per_step(cfg, batch, batch * c, w_bytes // 2),
                              bw, peak) for c in contexts]
            ax.plot(contexts, [batch / t * 1e3 for t in ms], marker="o", label=f"batch {batch}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="tokens/s upper bound",
               title="Qwen3-8B decode on an H200 (4.3 TB/s): roofline\n(only where weights + KV fit in 141 GB)")
        ax.legend()

    save_plot(args, "00_roofline", draw)


if __name__ == "__main__":
    main()
