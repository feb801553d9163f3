"""Tutorial 05: delayed verification, overlapping the host's bookkeeping of step t-1 with the device's step t.

    python -m tutorials.05_delayed_verification            # under a minute on a laptop CPU
    python -m tutorials.05_delayed_verification --quick    # seconds, tiny random model
    python tutorials/05_delayed_verification.py --quick    # the same, run as a file

Every step ends with host work: copy the verification results back, commit the accepted tokens, roll back the KV of
rejected drafts, pick the next critical positions. In a synchronous loop the device waits while the host works.
Delayed verification launches step t before processing step t-1, so on a GPU the host's work for step t-1 runs
while the device computes step t. The price: a request that verified at t-1 cannot run at step t (the host does
not yet know how many of its drafts survived, so it has no next input token). It *stalls* for one step.
Plain decoding has no such stall: each of its steps commits exactly one token, so the next position is known before
the token is, and the next step reads the token where it already lies, on the device (`SpecConfig.runs_ahead`; the
baseline every benchmark compares against runs this way).

The script decodes 4 short prompts, 32 new tokens each: first plainly (the reference), then with method='pillar',
k = 4, balanced, sync, async (`SpecConfig.async_verify`) and async drafting ahead. It records every step with
`on_step` (a `StepLog`) and every commit with `on_commit`. Numbers from one default run on a shared 2-core cloud VM:

1. The engine loop, both ways (async_loop.Engine.run):
       sync : works = schedule(t);  result = launch(works);  process(result)
       async: works = schedule(t);  result = launch(works);  process(previous);  previous = result

2. The step timeline: P prefill, D draft, V verify, s stall. Sync: one V every k + 1 = 5 steps per request. Async:
   every V is followed by an s, so a request's cycle is k + 2 = 6 steps; each request also stalls once right after
   its prefill, while its first token is in flight.

3. What happens at each step with delayed verification: for steps 1-7, what schedule(t) planned and what
   process(t-1) committed while step t ran, e.g.
       t=6   schedule(6): r0 V, r1 D, r2 D, r3 D   launch(6)   process(5): nothing to commit
       t=7   schedule(7): r0 s, r1 D, r2 D, r3 D   launch(7)   process(6): r0 +5 tokens
   r0 verified at step 6; its result is committed during step 7, which it sits out. In all, 38 of 199 decoding
   request-steps were stalls (19%): one per cycle (1/6 = 17%) plus one after each prefill.

4. The price and the prize. The sync run's steps split into launch (163 ms per step in the quoted run, which on a
   CPU includes the whole forward: torch runs every op as it is issued) and host work (0.5 ms). So on a CPU
   nothing overlaps and the async run simply has more steps (58 against 48). On a GPU, launch only queues kernels;
   two text lanes show both loops with host work half as long as a device step ('#' device busy, '=' host busy).
   Sync costs device + host per step, async max(device, host), but each request gives one step in k + 2 to the
   stall, so async wins when host time exceeds 1/(k + 1) of the device time:
                     host / device time  async speed-up (k = 4)
       this CPU run                0.2%                    0.84
                                  10.0%                    0.92
                                  20.0%                       1
                                  50.0%                    1.25
   Host work grows with the batch (Python bookkeeping per request) while a memory-bound GPU step barely does, so at
   large batch on a GPU the host's share is what decides.

5. The output does not change: plain == sync == async, every request, token for token (checked; the script stops
   with an error otherwise). Delay changes when the host learns a result, never what was computed: the stalled
   request does nothing meanwhile, no draft builds on unverified state, and every token passes the same
   verification against the same full-attention target.

6. Drafting ahead of the result removes the stall (`SpecConfig.draft_ahead`, the engine's default; a third run,
   'ahead'): the request drafts on the step after its verification, at the position (after the accepted drafts) and
   on the token (the verification's next) that the verification left on the device, with its previous selection.
   9 of 181 decoding request-steps stalled (after each prefill, and near a request's end), in 53 steps against 58.

With matplotlib: tutorials/out/05_delayed_verification.png, the three timelines as coloured grids.

Next: tutorial 06 bounds the KV pool and spills whole requests to host memory.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import statistics
import time

from nano_sparsespec import SamplingParams

from tutorials._common import (SHORT_PROMPTS, StepLog, load_llm, parser, save_plot, section, start, table,
                               timeline, with_spec)

LOOPS = """\
  sync : for t = 0, 1, ...:  works = schedule(t);  result = launch(works);  process(result)
  async: for t = 0, 1, ...:  works = schedule(t);  result = launch(works);  process(previous);  previous = result"""


def lanes(device_ms: float, host_ms: float, steps: int, overlap: bool, ms_per_char: float) -> tuple[str, str]:
    """Two text lanes, device and host, of `steps` steps: '#' busy, ' ' idle. Step t's host work processes step t
    (sync: after the device finishes) or step t-1 (async: while the device runs step t)."""
    device, host, clock = [], [], 0.0
    for t in range(steps):
        device.append((clock, clock + device_ms))
        if overlap:                          # process(t-1) starts as soon as step t is launched
            if t > 0:
                host.append((clock, clock + host_ms))
            clock += max(device_ms, host_ms)
        else:                                # process(t) waits for step t, and step t+1 waits for it
            host.append((clock + device_ms, clock + device_ms + host_ms))
            clock += device_ms + host_ms
    width = round(clock / ms_per_char)

    def draw(spans, mark):
        cells = [" "] * width
        for a, b in spans:
            for c in range(round(a / ms_per_char), min(width, round(b / ms_per_char))):
                cells[c] = mark
        return "".join(cells)

    return draw(device, "#"), draw(host, "=")


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 05: delayed verification")
    llm = load_llm(args)
    batch, k, new_tokens = (3, 3, 10) if args.quick else (4, 4, 32)
    prompts = [llm.encode(p) for p in SHORT_PROMPTS[:batch]]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with_spec(llm, method="plain")
    plain = [o.token_ids for o in llm.generate(None, params, prompt_token_ids=prompts)]

    runs = {}
    for mode, async_verify, draft_ahead in (("sync", False, False), ("async", True, False), ("ahead", True, True)):
        with_spec(llm, method="pillar", stride=k, min_budget=16, batch_policy="balanced", async_verify=async_verify,
                  draft_ahead=draft_ahead)
        commits = []                                 # (step being scheduled when the commit happened, request, tokens)
        log = StepLog()

        def record(seq, tokens, accepted, log=log, commits=commits, delayed=async_verify):
            # The step the engine is at: the last one launched, unless that step holds this very verification and
            # its result is being processed a step later (delayed): then the engine is at the next step, which
            # launched nothing (every request waited for a result).
            last = log.steps[-1]
            at = last.index + (delayed and last.actions.get(seq.seq_id) in ("V", "P"))
            commits.append((at, seq.seq_id, len(tokens)))

        t0 = time.perf_counter()
        outs = llm.generate(None, params, prompt_token_ids=prompts, on_step=log.record, on_commit=record)
        runs[mode] = (log, commits, [o.token_ids for o in outs], time.perf_counter() - t0)

    section("1. The engine loop, with and without delayed verification")
    print(LOOPS)
    print("launch() queues the step's work on the device and returns; process() is the one place the host waits for "
          "a result (it copies accepted counts and tokens back), then commits tokens, rolls back rejected KV and "
          "refreshes the critical positions. Async processes step t-1 AFTER launching step t.")

    section(f"2. The step timeline ({batch} requests, method='pillar', k = {k}, balanced; 'ahead' in section 6)")
    for mode, (log, *_rest) in runs.items():
        timeline(log, count=40, label=mode)
    print("P prefill, D draft, V verify, s stall. Sync: each request verifies every k+1 = "
          f"{k + 1} steps. Async: every k+2 = {k + 2} steps, because the step after a verification is a stall.")

    section("3. What happens at each step with delayed verification")
    log, commits, _, _ = runs["async"]
    first = next(i for i, s in enumerate(log.steps) if "P" not in s.actions.values())
    for s in log.steps[first:first + (4 if args.quick else 7)]:
        plan = ", ".join(f"r{i} {a}" for i, a in sorted(s.actions.items()))
        done = [f"r{i} +{n} tokens" for t, i, n in commits if t == s.index]
        print(f"  t={s.index:<3} schedule({s.index}): {plan:<26} launch({s.index})   process({s.index - 1}): "
              f"{', '.join(done) or 'nothing to commit'}")
    print("A request that verified at t-1 has not been processed when step t is scheduled: the host does not yet know "
          "how many of its drafts survive, so it cannot feed it a next token. It stalls ('s') for that one step.")
    decoding = [a for s in log.steps for a in s.actions.values() if a in "DVs"]
    stalls = decoding.count("s")
    print(f"stall steps: {stalls} of {len(decoding)} decoding request-steps ({stalls / len(decoding):.0%}; one per "
          f"cycle of k+2 = {k + 2} is {1 / (k + 2):.0%}, plus the step after each prefill)")

    section("4. The price and the prize: host time vs device time")
    log = runs["sync"][0]
    steps = [(s.launch_seconds, d) for s, d in zip(log.steps, log.durations())]
    device = 1e3 * statistics.mean(a for a, _ in steps)
    host = 1e3 * statistics.mean(d - a for a, d in steps)
    table(["mode", "steps", "seconds", "ms per step"],
          [[mode, len(lg.steps), round(secs, 2), round(1e3 * secs / len(lg.steps), 1)]
           for mode, (lg, _, _, secs) in runs.items()])
    print(f"sync run: launch {device:.1f} ms per step (on this CPU the forward runs inside launch), host work "
          f"(schedule + process) {host:.1f} ms per step. On a CPU torch runs each op as it is issued, so nothing "
          "overlaps: the difference in seconds above comes from the different mix of steps. On a GPU launch returns "
          "at once and the device computes while the host works. With host work half as long as a device step, the "
          f"two loops look like this over {k + 2} steps (# device busy, = host busy):")
    for mode, overlap in (("sync", False), ("async", True)):
        d_lane, h_lane = lanes(2.0, 1.0, k + 2, overlap, ms_per_char=0.25)
        print(f"  {mode:<5} device |{d_lane}|\n        host   |{h_lane}|")
    print("Per step: sync costs device + host; async costs max(device, host) but gives up one step in k+2 per "
          "request to the stall. Worth it when host time exceeds 1/(k+1) of the device time:")
    rows = []
    for name, ratio in (("this CPU run", host / device), ("", 0.05), ("", 0.1), ("", 0.2), ("", 0.5)):
        gain = (1 + ratio) / max(1, ratio) * (k + 1) / (k + 2)
        rows.append([name, f"{ratio:.1%}", round(gain, 2)])
    table(["", "host / device time", f"async speed-up (k = {k})"], rows)
    print("Host work grows with the batch (Python bookkeeping per request) while a GPU step of a memory-bound batch "
          "barely does: at large batch on a GPU the host's share is what decides.")

    section("5. The output does not change")
    same = plain == runs["sync"][2] == runs["async"][2] == runs["ahead"][2]
    print(f"plain == sync == async == ahead, every request, token for token: {same}")
    print("Delaying only changes WHEN the host learns a verification's result, not WHAT was computed: the stalled "
          "request does nothing in between, drafts never build on unverified state, and every token still passes "
          "the same verification against the same full-attention target.")
    if not same:
        raise SystemExit("delayed verification changed the output: this is a bug")

    section("6. Drafting ahead of the result: no stall")
    log = runs["ahead"][0]
    decoding = [a for s in log.steps for a in s.actions.values() if a in "DVs"]
    print(f"The 'ahead' run (SpecConfig.draft_ahead, the default) stalled {decoding.count('s')} of {len(decoding)} "
          f"decoding request-steps, in {len(log.steps)} steps against the async run's {len(runs['async'][0].steps)}: "
          "after each prefill (there is no selection to draft from yet) and near a request's end (where one more "
          "draft could pass its last token). Elsewhere, on the step after its verification a request drafts anyway. "
          "Its position (after the accepted drafts) and its input (the verification's next token) exist only on the "
          "device: the verification leaves both there, and the draft step reads them. It attends to its previous "
          "selection and to the verification's K/V of the positions just accepted; the selection made from the "
          "result meanwhile serves the drafts after it. Its drafts are accepted a little less often (an older "
          "selection), but no request gives up a step.")

    def draw(plt):
        colors = {"P": 0, "D": 1, "V": 2, "s": 3}
        fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 0.5 * batch * len(runs)))
        for ax, (mode, (lg, *_rest)) in zip(axes, runs.items()):
            grid = [[colors.get(s.actions.get(i, ""), float("nan")) for s in lg.steps] for i in range(batch)]
            ax.imshow(grid, aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
            ax.set(title=f"{mode}: blue prefill, orange draft, green verify, red stall", xlabel="step",
                   ylabel="request", yticks=range(batch))

    save_plot(args, "05_delayed_verification", draw)


if __name__ == "__main__":
    main()
