import sys, time, torch
from nano_sparsespec import LLM, SamplingParams
Q = ["Prove that the square root of 2 is irrational. Explain each step.",
     "A train travels 120 km in 1.5 hours and then 80 km in 1 hour. What is its average speed? Think step by step.",
     "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
     "If 3x + 7 = 25, what is x? Show your reasoning.",
     "How many prime numbers are there between 1 and 50? List them and explain how you checked.",
     "Explain why the angles of a triangle add up to 180 degrees.",
     "What is the derivative of x^3 * sin(x)? Show the product rule step by step.",
     "A box has 3 red and 5 blue balls. Two are drawn without replacement. What is the probability both are red?"]
B, N = int(sys.argv[1]), int(sys.argv[2])
prompts = [Q[i % len(Q)] for i in range(B)]
for name, kw in [("plain", dict(method="plain")), ("pillar-naive", dict(method="pillar", batch_policy="naive")),
                 ("pillar-balanced", dict(method="pillar")), ("pillar-balanced-async", dict(method="pillar", async_verify=True))]:
    llm = LLM(gguf="/root/m/smollm2.gguf", device="cuda", max_batch=B, **kw)
    llm.generate(prompts[:4], SamplingParams(max_new_tokens=16, ignore_eos=True))   # warm-up
    torch.cuda.synchronize(); t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    s = llm.last_stats.summary(8)
    print(f"{name:24s} B={B} N={N} {s['output_tokens']/dt:9.1f} tok/s steps={s['steps']} ms/step={1000*dt/s['steps']:.2f} acc={s.get('mean_accepted')}", flush=True)
