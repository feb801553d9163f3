"""Tutorial 06: the dynamic KV cache, a bounded pool of blocks that spills whole requests to host memory.

    python -m tutorials.06_dynamic_kv_cache            # under a minute on a laptop CPU
    python -m tutorials.06_dynamic_kv_cache --quick    # seconds, tiny random model
    python tutorials/06_dynamic_kv_cache.py --quick    # the same, run as a file

The KV cache is paged: the device pool is a set of blocks of `block_size` tokens and each request owns a block
table, so requests grow and shrink without moving anyone else's KV. A reasoning request's final length is unknown,
so reserving the worst case for every request wastes most of the pool. SparseSpec admits requests optimistically
and, when the next step's KV does not fit, moves one whole request's KV to host memory (offload), bringing it back
when there is room again (restore). Numbers from one default run on a 2-core cloud VM:

1. The paged pool, step by step, on a real `KVCache` of 8 blocks of 4 tokens (one layer, one KV head, head_dim 2):
       append r0 10, r1 5     r0 gets blocks [0, 1, 2] (10 tokens), r1 [3, 4] (5 tokens)
       rollback r0 3          3 rejected drafts are forgotten: r0 keeps [0, 1] (7 tokens), block 2 is free again
       offload r0             r0's blocks are copied to the host pool and freed on the device
       append r1 8            r1 grows into freed blocks: [3, 4, 5, 6]
       restore r0             r0 comes back into blocks [7, 2]
   and the check: r0's K is byte for byte what it was before it left, though it now lives in other blocks.

2. How many requests fit? Qwen3-8B on an H200: 141 GB - 16.4 GB of weights leaves 125 GB, 0.85 M tokens of
   144 KiB: 206 requests of 4K tokens, 103 of 8K, 51 of 16K, 25 of 32K (before activations and workspace).

3. A bounded pool in the real engine: 8 short prompts, 40 new tokens each, method='pillar', k = 4. A request may
   need 6 blocks of 16 tokens (prompt + new tokens + one cycle of drafts), 48 blocks for all; the bounded run gets
   14 (`SpecConfig.kv_blocks`). Its timeline marks o for offloaded and . for admitted but waiting for room for its
   prompt: r3 leaves at step 11 and comes back at step 46, r4 is admitted at once but waits until step 13, and so on.
       pool       most decoding at once  offloads  restores  steps  seconds
       unbounded                      8         0         0     52     12.1
       14 blocks                      4         4         4    160     35.7
   The bound costs steps (fewer requests decode at once), not correctness: the outputs are identical with and
   without it, which the script checks. The policy lives in scheduler.py: the victim is the most recently admitted
   request with no result in flight (exercise 5), offloaded requests return first-out first-in once their blocks
   plus a step of headroom fit, and nobody new is admitted while one is out.

With matplotlib: tutorials/out/06_dynamic_kv_cache.png, requests on the device and in host memory per step.

Next: tutorial 07 puts it all together with the command line and the benchmark.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time

import torch

from nano_sparsespec import SamplingParams
from nano_sparsespec.kv_cache import KVCache

from tutorials._common import (SHORT_PROMPTS, StepLog, load_llm, parser, save_plot, section, start, table,
                               timeline, with_spec)
from tutorials._roofline import GB, H200, QWEN3_8B, kv_bytes_per_token, weight_bytes_per_step


def show(cache: KVCache, what: str) -> None:
    """One line of pool state: every request's block table, the free device blocks, the host tables."""
    device = ", ".join(f"r{i}: {t} ({cache.length(i)} tok)" for i, t in sorted(cache.pool.tables.items()))
    host = ", ".join(f"r{i}: {t}" for i, t in sorted(cache.host_pool.tables.items())) or "-"
    print(f"  {what:<28} device {{{device}}}  free {sorted(cache.pool.free)}  host {{{host}}}")


def mechanics() -> None:
    """The KVCache's own operations on a pool of 8 blocks of 4 tokens (one layer, one KV head, head_dim 2)."""
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=8, block_size=4, dtype=torch.float32,
                    device="cpu", host_blocks=8)
    cache.append(0, 10)
    cache.append(1, 5)
    for seq_id in (0, 1):                        # write something recognisable: K = (request, position)
        n = cache.length(seq_id)
        slots = cache.slots_of(seq_id, torch.arange(n))
        cache.k[0, slots, 0] = torch.stack([torch.full((n,), float(seq_id)), torch.arange(n).float()], -1)
    show(cache, "append r0 10, r1 5")
    cache.rollback(0, 3)
    show(cache, "rollback r0 3 (rejected)")
    before = cache.k[0, cache.slots_of(0, torch.arange(7)), 0].clone()    # [7, head_dim]
    left_from = list(cache.pool.tables[0])
    cache.offload(0)
    show(cache, "offload r0")
    cache.append(1, 8)
    show(cache, "append r1 8 (it grows)")
    cache.restore(0)
    show(cache, "restore r0")
    after = cache.k[0, cache.slots_of(0, torch.arange(7)), 0]
    print(f"  r0 left blocks {left_from} and came back into {cache.pool.tables[0]}; its K, byte for byte the same: "
          f"{torch.equal(before, after)}")


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 06: the dynamic KV cache")

    section("1. The paged pool: block tables, rollback, offload and restore (nano_sparsespec.kv_cache.KVCache)")
    mechanics()

    section("2. How many requests fit? (Qwen3-8B in bf16 on an H200)")
    kv_token = kv_bytes_per_token(QWEN3_8B, 2)
    free = H200[2] - weight_bytes_per_step(QWEN3_8B, 2) - QWEN3_8B.vocab_size * QWEN3_8B.hidden_size * 2
    print(f"141 GB - {(H200[2] - free) / GB:.1f} GB of weights = {free / GB:.0f} GB for KV (before activations and "
          f"workspace), {free / kv_token / 1e6:.2f} M tokens of {kv_token // 1024} KiB")
    rows = [[length, round(length * kv_token / GB, 2), int(free // (length * kv_token))]
            for length in (4096, 8192, 16384, 32768)]
    table(["tokens per request", "GB per request", "requests that fit"], rows)
    print("A reasoning request grows as it decodes and nobody knows its final length. Reserving the worst case for "
          "each wastes most of the pool; admitting optimistically means the pool can run out mid-flight. The dynamic "
          "cache admits optimistically and, when the next step does not fit, moves a whole request's KV to host "
          "memory (offload) and brings it back later (restore).")

    section("3. A bounded pool in the real engine")
    llm = load_llm(args)
    batch, k, new_tokens = (4, 3, 12) if args.quick else (8, 4, 40)
    prompts = [llm.encode(p) for p in (SHORT_PROMPTS * 2)[:batch]]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    block = 16       # small blocks show the pool's granularity (the engine's default, 64, suits the GPU's paged kernel)
    per_request = max(-(-(len(p) + new_tokens + k + 2) // block) for p in prompts)
    bounded = 2 * per_request + 2
    print(f"{batch} requests, {new_tokens} new tokens each, method='pillar', k = {k}; a request needs up to "
          f"{per_request} blocks of {block} tokens: all of them need {batch * per_request} blocks")
    runs = {}
    for name, kv_blocks in (("unbounded", None), (f"{bounded} blocks", bounded)):
        with_spec(llm, method="pillar", stride=k, min_budget=16, kv_blocks=kv_blocks, block_size=block)
        log = StepLog()
        t0 = time.perf_counter()
        outs = llm.generate(None, params, prompt_token_ids=prompts, on_step=log.record)
        runs[name] = (log, llm.last_stats, time.perf_counter() - t0, [o.token_ids for o in outs])
    log = runs[f"{bounded} blocks"][0]
    timeline(log, count=70, label=f"{bounded} blocks")
    print("P prefill, D draft, V verify, o offloaded (its KV sits in the host pool), . admitted but waiting for room "
          "for its prompt, blank: not admitted yet or finished")
    rows = [[name, max(sum(a in "DVs" for a in s.actions.values()) for s in lg.steps), stats.offloads,
             stats.restores, len(lg.steps), round(secs, 1)] for name, (lg, stats, secs, _) in runs.items()]
    table(["pool", "most decoding at once", "offloads", "restores", "steps", "seconds"], rows)
    print("The price of the bound: fewer requests decode at once, so the same work takes more steps. The scheduler's "
          "policy (scheduler.py): when the next step's KV does not fit, the most recently admitted "
          "request with no result in flight leaves; offloaded requests come back first-out first-in once their blocks "
          "plus a step of headroom fit, and nobody new is admitted while one is out. Exercise 5 asks you to write "
          "that victim choice.")
    same = runs["unbounded"][3] == runs[f"{bounded} blocks"][3]
    print(f"outputs identical with and without the bound: {same}")
    if not same:
        raise SystemExit("offloading changed the output: this is a bug")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 3))
        steps = range(len(log.steps))
        ax.stackplot(steps, [s.running for s in log.steps], [s.offloaded for s in log.steps],
                     labels=["admitted, on the device", "offloaded (KV in host memory)"])
        ax.set(xlabel="step", ylabel="requests", title=f"{batch} requests in a pool of {bounded} blocks")
        ax.legend(loc="upper right")

    save_plot(args, "06_dynamic_kv_cache", draw)


if __name__ == "__main__":
    main()
