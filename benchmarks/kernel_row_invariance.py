"""Which library kernels give a row the same bits whatever the number of rows beside it (run on a GPU).

`python benchmarks/kernel_row_invariance.py` prints, for the embedded model's matmul shapes, batched 16- and 32-row
products as in dense attention, and a row reduction as in an RMS norm, whether a row's result changes with the rows
beside it; `benchmarks/results/parity/h200.txt` holds the H200's answer. This is why batch_invariant.py tiles rows.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


def report(name: str, equal_by_size: dict) -> None:
    bad = [n for n, equal in equal_by_size.items() if not equal]
    print(f"{name}: {'row-invariant' if not bad else f'differs at {bad}'}", flush=True)


for K, N in ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)):   # qkv, o, gate_up, down, LM head
    w = (torch.randn(N, K, device=device) * 0.05).bfloat16()
    x = torch.randn(9216, K, device=device).bfloat16()
    ref = F.linear(x[:16], w)
    report(f"mm bf16 K={K} N={N}, rows 1..9216 against 16",
           {m: torch.equal(F.linear(x[:m], w)[:16], ref[:m]) for m in (1, 9, 16, 32, 272, 1024, 4608, 9216)})
for M in (16, 32):                                       # attention's logits: [batch, M rows, 64] @ [batch, 64, 64]
    q, k = torch.randn(30000, M, 64, device=device), torch.randn(30000, 64, 64, device=device)
    ref = torch.matmul(q[:3], k[:3])
    report(f"bmm fp32 {M} rows, batch 3..30000 against 3",
           {b: torch.equal(torch.matmul(q[:b], k[:b])[:3], ref) for b in (3, 30, 90, 300, 3000, 30000)})
x = torch.randn(9216, 576, device=device).bfloat16()
ref = x[:16].float().pow(2).mean(-1)
report("mean of squares over 576, rows 1..9216 against 16",
       {m: torch.equal(x[:m].float().pow(2).mean(-1)[:16], ref[:m]) for m in (1, 9, 16, 32, 272, 1024, 4608, 9216)})
