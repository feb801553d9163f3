"""Where does the engine loop wait for the GPU? Runs `LLM.generate` on CUDA with torch's sync debug mode on and counts
the host synchronisations by the package line that caused them.

    PYTHONPATH=.:tests python benchmarks/h200/session6/sync_check.py [--gguf G] [--batch 32] [--tokens 64] [MODE ...]

MODE: plain | pillar-naive | pillar-async (balanced, delayed verification); all three by default. Without --gguf it
uses a tiny random Qwen3 checkpoint (tests/conftest.py): where the syncs are does not depend on the weights.
An engine with delayed verification should wait once per step (`StepResult.fetch`), for the step before the last.
"""
import argparse
import collections
import tempfile
import traceback
import warnings

import torch

from nano_sparsespec import LLM, SamplingParams

from engine_split import MODES  # noqa: E402  (this folder is on sys.path when run as a script)


def package_frame() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "nano_sparsespec" in f.filename]
    return f"{frames[-1].filename.split('nano_sparsespec/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames \
        else "outside the package"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="*", default=list(MODES))
    p.add_argument("--gguf", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    model, ids = dict(gguf=args.gguf), None
    if not args.gguf:
        from conftest import make_tiny_checkpoint
        path, _ = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3", max_pos=2048)
        model = dict(model=str(path))
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 100, (args.batch,), generator=g)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0.6)
    for mode in args.modes:
        llm = LLM(**model, device="cuda", compile=True, cuda_graphs=True, max_batch=args.batch, min_budget=16,
                  **MODES[mode])
        texts = None if ids else ["Prove that the square root of 2 is irrational."] * args.batch
        run = lambda: llm.generate(texts, params, prompt_token_ids=ids)  # noqa: E731
        run()                                      # records the graphs, compiles the kernels
        counts = collections.Counter()
        with warnings.catch_warnings():            # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = lambda *a, **k: counts.update([package_frame()])
            torch.cuda.set_sync_debug_mode("warn")
            run()
            torch.cuda.set_sync_debug_mode("default")
        steps = llm.last_stats.steps
        print(f"{mode}: {steps} steps, {sum(counts.values())} synchronisations")
        for where, n in counts.most_common():
            print(f"  {n:6d}  {where}")


if __name__ == "__main__":
    main()
