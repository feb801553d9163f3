"""The host-and-CPU time of the engine steps that carry prefill chunks, against the others, with many requests
decoding beside the chunks (session 13: `StepShape.dense_runs`; session 14: the chunks in runs of like length, and
`--prefill-chunk`, whose default went from 512 to 2,048 prompt tokens per step).

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \
        PYTHONPATH=. python benchmarks/cpu/prefill_steps.py [--layers 30] [--batch 128] [--tokens 16] [--prefill-chunk N]

The two glibc settings keep freed memory in the heap. Without them, how fast the decoding steps ran depended on
what earlier steps had allocated: glibc raises its threshold for serving allocations by fresh (page-faulting)
mappings after large ones are freed, so the padded prefill steps of 71d2f26 made its later decoding steps' multi-MB
K/V gathers cheaper (42 ms per step against 60 for 675982c at --tokens 16; 58 against 56 with the settings). With
the embedded model (8 x 256 rows on the CPU bench) the settings made no difference.

A random tiny Qwen3 with `--layers` layers (hidden 64: the work per step is small, so per-layer and per-request costs
show), `--batch` prompts of 60-139 random tokens, plain decoding running ahead on the padded static-step code path
(`cuda_graphs=True`, which a CPU runs eagerly), chunked prefill of `--prefill-chunk` tokens per step. One untimed generation first,
then each step's `ModelRunner.launch` timed (on a CPU it runs the step)."""
import argparse
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.config import SpecConfig
from nano_sparsespec.runner import ModelRunner


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=SpecConfig.prefill_chunk)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      eos_token_id=255, bos_token_id=0)
    steps, launch = [], ModelRunner.launch

    def timed(self, works):
        start = time.perf_counter()
        result = launch(self, works)
        steps.append((time.perf_counter() - start, sum(w.kind == "prefill" for w in works), len(works)))
        return result
    ModelRunner.launch = timed
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(60, 140, (args.batch,), generator=g)]
    params = [SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0.6, seed=i)
              for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as path:
        Qwen3ForCausalLM(cfg).save_pretrained(path)
        llm = LLM(path, device="cpu", dtype="float32", cuda_graphs=True, max_batch=args.batch, method="plain",
                  async_verify=True, prefill_chunk=args.prefill_chunk)
        llm.generate(None, params, prompt_token_ids=prompts)
        steps.clear()
        llm.generate(None, params, prompt_token_ids=prompts)
    chunks = [s for s in steps if s[1]]
    others = [s for s in steps if not s[1]]
    print(f"{len(chunks)} steps with prefill chunks: {sum(s[0] for s in chunks) / len(chunks) * 1e3:.1f} ms on "
          f"average; {len(others)} other steps: {sum(s[0] for s in others) / len(others) * 1e3:.1f} ms")
    print("steps with chunks (ms, chunks / works): " + ", ".join(f"{s[0] * 1e3:.0f} ({s[1]} / {s[2]})" for s in chunks))


if __name__ == "__main__":
    main()
