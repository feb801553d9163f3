"""How long one long prompt takes to prefill on the CPU (the embedded model, one thread): 1,800 random prompt tokens
and one new token, after a short untimed run, for a prefill budget (`--prefill-chunk`) and a method.

    PYTHONPATH=. python benchmarks/cpu/long_prompt_prefill.py CHUNK METHOD      (e.g. 2048 pillar)

Session 14: with PillarAttn (`pillar`), every row of a final prefill chunk was scored though only its last carries a
weight; at 2,048 tokens per step that made this prefill 29.4 s against plain decoding's 8.7
(benchmarks/cpu/session14_long_prompt.txt)."""
import sys
import time

import torch

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.embedded import embedded_model_dir

torch.set_num_threads(1)
chunk = int(sys.argv[1])
llm = LLM(str(embedded_model_dir()), device="cpu", method=sys.argv[2], prefill_chunk=chunk)
g = torch.Generator().manual_seed(0)
ids = torch.randint(100, 40000, (1800,), generator=g).tolist()
p = SamplingParams(max_new_tokens=1, ignore_eos=True)
llm.generate(None, [p], prompt_token_ids=[ids[:100]])
t = time.perf_counter()
llm.generate(None, [p], prompt_token_ids=[ids])
print(f"chunk {chunk}: prefill of 1800 tokens + 1 token: {time.perf_counter() - t:.2f} s")
