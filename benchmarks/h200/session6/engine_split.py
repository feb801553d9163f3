"""Where an engine step's wall time goes on the host: scheduling, building the step, queueing the forward, sampling
and verification, the host bookkeeping, and how long the host waits for the GPU (`StepResult.fetch`).

    PYTHONPATH=. python benchmarks/h200/session6/engine_split.py --gguf G [--batch 128] [--tokens 512] [MODE ...]

MODE: plain | plain-ahead (overlapped) | pillar-naive | pillar-async (balanced, delayed verification). Each mode
generates once for `--batch` requests (the packaged reasoning prompts; compile + CUDA graphs, temperature 0.6, EOS
ignored); the time spent recording CUDA graphs is left out of the wall time, the launch and the forward. Timers are
host perf_counter totals around the named methods (no added synchronisation): a host that mostly waits in `fetch` is
GPU-bound; one that rarely waits is bound by its own work.
Caveat (raw/engine_split_call4.txt): with no warm-up generation, the first mode run in a process also pays the
compilation of the prefill steps' kernels inside `launch` (plain: 21.7 ms per step of launch outside the forward,
sampling and verification); engine_profile.py warms up first and profiles steady-state steps only.
Session 8: the parts of `launch` are timed too, and so are apart the launches of steps that hold a prefill chunk
(eager); `--warm-up N` first generates N tokens with the same settings (compiling what the first steps of each kind
compile; since session 9 also for the first request alone), and the timers count the second generation only.
Session 9: the mode's line says how long torch.compile compiled inside the timed run (shapes the warm-up did not
meet: in the timers unless it fell inside graph recording); request i samples with seed i (before, seeds were
random: runs of one mode differed in acceptance and in their number of steps, e.g. 2,054 and 2,295 steps for
pillar-async in session 9's calls 7 and 11).
Session 10: a static step's graph holds draft sampling and verification too (`ModelRunner._compute`), so they are
no longer timed apart: they are part of "replay" (recording left out) or, in steps with a prefill chunk, of that line.
Session 11: a static step's graph also builds the step's tensors from its uploaded lists (the dense and sparse
batches), and the lists come padded to the bucket: "padded lists" holds the list lines below it, "replay" the one
device copy of the lists into the static step.
Session 18: `--requests N` (default `--batch`) runs more requests than slots, as the bench's `--num-requests` does (a
finished request's slot takes the next waiting one), and the line of steps with a prefill chunk says how many there
were: that traced why the seventeenth session's rows with 384 requests cost 1.6x more per step than with 128 (each
admission was an eager step; BENCHMARKS.md, H200 eighteenth session).
Session 19: a step's prefill chunks are a static step of their own (`ModelRunner.launch`), so the line of steps with a
prefill chunk times their two replays (and, unlike the lines above it, the recording of the prefill buckets first met
in the timed run). `--admission-group G` (at fc10892) overrode the engine's admission groups: groups of 1 and of 8
ran alike once prefill chunks were replayed, and the groups were removed.
"""
import argparse
import collections
import inspect
import time

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.async_loop import Engine
from nano_sparsespec.bench import DEFAULT_PROMPTS, compile_seconds, load_workload
from nano_sparsespec.cuda_graphs import StaticStep, StepGraphs
from nano_sparsespec.device import Packed
from nano_sparsespec.runner import ModelRunner, StepResult
from nano_sparsespec.scheduler import Scheduler

MODES = {"plain": dict(method="plain"),
         "plain-ahead": dict(method="plain", async_verify=True),      # overlapped plain decoding (session 8)
         "pillar-naive": dict(method="pillar", batch_policy="naive"),
         "pillar-async": dict(method="pillar", batch_policy="balanced", async_verify=True)}
# (class, method, label); nested ones are parts of the one above them
TIMED = [(Scheduler, "schedule", "schedule"),
         (ModelRunner, "launch", "launch"),
         # the parts of building a step (session 8; session 11: padded lists, the one copy, the device step)
         (ModelRunner, "_lists", "  padded lists"),
         (ModelRunner, "_token_lists", "    token lists"),
         (ModelRunner, "_dense_lists", "    dense lists"),
         (ModelRunner, "_sparse_lists", "    sparse lists"),
         (ModelRunner, "_check_lists", "    check lists"),
         (ModelRunner, "_table_changes", "  block-table changes"),
         (ModelRunner, "_send_sampling_params", "  sampling parameters"),
         (Packed, "__init__", "  the one copy"),
         (ModelRunner, "_apply_table_changes", "  write the block-table changes"),
         (StepGraphs, "run", "  device step (static: copy the lists in, replay)"),
         (StaticStep, "run", "    replay"),
         (StepResult, "start_copy", "  queue the result copy"),
         (Engine, "_process", "process"),
         (StepResult, "fetch", "  fetch (waiting for the GPU)"),
         (Engine, "_refresh_drafting_state", "  refresh critical positions")]
totals = collections.Counter()
calls = collections.Counter()


def add_timer(cls, name, label, when=None):
    """Add the wall time of calls to cls.name to totals[label] (only calls whose arguments satisfy `when`)."""
    original = getattr(cls, name)

    def timed(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return original(*args, **kwargs)
        calls[label] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
    is_static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    setattr(cls, name, staticmethod(timed) if is_static else timed)


def time_prefill_launches():
    """Also count apart the launch time of steps that hold a prefill chunk (these run eagerly, not replayed)."""
    add_timer(ModelRunner, "launch", PREFILL_LABEL, when=lambda self, works: any(w.kind == "prefill" for w in works))


PREFILL_LABEL = "  of which steps with a prefill chunk"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="*", default=list(MODES))
    p.add_argument("--gguf", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: --batch)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm-up", type=int, default=0, help="first generate this many tokens, untimed")
    args = p.parse_args()
    for cls, name, label in TIMED:
        add_timer(cls, name, label)
    time_prefill_launches()
    # request i samples with seed i, as the bench's rows do: two runs of a mode draft and accept alike (session 9)
    params = [SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0.6, seed=i)
              for i in range(args.requests or args.batch)]
    for mode in args.modes:
        llm = LLM(gguf=args.gguf, device=args.device, compile=True, cuda_graphs=True, max_batch=args.batch,
                  **MODES[mode])
        texts, ids = load_workload(llm, DEFAULT_PROMPTS, "prompt", len(params), chat_template=True)
        if args.warm_up:
            short = [SamplingParams(max_new_tokens=args.warm_up, ignore_eos=True, temperature=0.6, seed=i)
                     for i in range(args.batch)]
            llm.generate(texts[:args.batch], short, prompt_token_ids=ids[:args.batch])
            llm.generate(texts[:1], short[:1], prompt_token_ids=ids[:1])     # a batch of one too (session 9)
        totals.clear()
        calls.clear()
        compiled = compile_seconds()
        llm.generate(texts, params, prompt_token_ids=ids)
        compiled = compile_seconds() - compiled
        stats = llm.last_stats
        recording = stats.graph_record_seconds                  # one-time, inside the forward: left out
        for label in ("launch", "  device step (static: copy the lists in, replay)", "    replay"):
            totals[label] -= recording
        per_step = 1e3 / stats.steps
        print(f"{mode}: {stats.output_tokens / (stats.seconds - recording):.0f} tok/s, {stats.steps} steps, "
              f"{(stats.seconds - recording) * per_step:.2f} ms per step ({stats.graphs_recorded} graphs recorded "
              f"in {recording:.1f} s, left out), mean accepted {stats.summary(8).get('mean_accepted')}; "
              f"torch.compile compiled for {compiled:.1f} s inside the timed run "
              f"({stats.graph_record_compile_seconds:.1f} s of it while recording graphs)")
        for label in [label for _, _, label in TIMED[:2]] + [PREFILL_LABEL] + [label for _, _, label in TIMED[2:]]:
            steps = f" ({calls[label]} steps)" if label == PREFILL_LABEL else ""
            print(f"  {label:38s} {totals[label] * per_step:7.3f} ms/step{steps}")


if __name__ == "__main__":
    main()
