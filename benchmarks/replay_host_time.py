"""What a recorded step costs the host to queue (GPU only): each replay's copy-in and `replay()` call, timed
in the engine (`cuda_graphs.StaticStep.run` wrapped), for the step graphs and the selection refresh's apart.

Random weights of the embedded model's shape (tokens need no meaning: only host times are read), pillar-lookup
with balanced batching and delayed verification, `--compile --cuda-graphs`, bf16, BATCH requests (default 512) of
60-130 prompt tokens x 1,024 new tokens, `refresh_every` 3. Recordings are left out (a bucket's first run).

    python benchmarks/replay_host_time.py [BATCH]
"""
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nano_sparsespec import LLM, SamplingParams, cuda_graphs
from nano_sparsespec.refresh_graphs import RefreshShape

EMBEDDED_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, eos_token_id=0)


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    path = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**EMBEDDED_SHAPE)).to(torch.bfloat16).save_pretrained(path)
    timed = {"step": ([], []), "refresh": ([], [])}       # kind -> (copy-in seconds, replay seconds)
    run = cuda_graphs.StaticStep.run

    def timed_run(step, packed, names):
        if step.graph is None:                                   # recorded in this call: not timed
            return run(step, packed, names)
        started = time.perf_counter()
        cuda_graphs._layout(packed, names)
        step.inputs.copy_(packed.flat[:step.inputs.shape[0]])
        copied = time.perf_counter()
        step.graph.replay()
        copy_in, replay = timed["refresh" if isinstance(step.shape, RefreshShape) else "step"]
        copy_in.append(copied - started)
        replay.append(time.perf_counter() - copied)
        return step.outputs

    cuda_graphs.StaticStep.run = timed_run
    llm = LLM(path, device="cuda", dtype="bfloat16", compile=True, cuda_graphs=True, method="pillar-lookup",
              batch_policy="balanced", async_verify=True, max_batch=batch, refresh_every=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49000) for _ in range(rng.randrange(60, 130))] for _ in range(batch)]
    llm.generate(None, SamplingParams(max_new_tokens=1024, temperature=0.6, ignore_eos=True, seed=1),
                 prompt_token_ids=prompts)
    stats = llm.last_stats
    print(f"{torch.cuda.get_device_name()}, batch {batch}: {stats.steps} steps, "
          f"{stats.graphs_recorded} graphs recorded in {stats.graph_record_seconds:.1f} s")
    for kind, (copy_in, replay) in timed.items():
        if replay:
            deciles = lambda v: " / ".join(f"{1e3 * x:.3f}" for x in statistics.quantiles(v, n=10)[::4])
            print(f"{kind}: {len(replay)} replays; ms p10 / p50 / p90: copy-in {deciles(copy_in)}, "
                  f"replay {deciles(replay)}")


if __name__ == "__main__":
    main()
