"""Which library kernels give a row the same bits whatever the number of rows beside it (run on a GPU).

`python benchmarks/kernel_row_invariance.py` prints, for the embedded model's matmul shapes, batched 16- and 32-row
products as in dense attention, and a row reduction as in an RMS norm, whether a row's result changes with the rows
beside it; `benchmarks/results/parity/h200.txt` holds the H200's answer. This is why batch_invariant.py tiles rows.
Then the fast path's pieces as `--compile --exact` compiles them: the paged kernel with exact rows (a verification's
row against the decode row of its position, over the same pool; a decode row in batches of two sizes) and the fused
elementwise ops.
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

from nano_sparsespec import kernels, model  # noqa: E402  (after the library probes: they need none of it)
from nano_sparsespec import paged as paged_kernel  # noqa: E402

if device == "cuda":
    kernels.compile_kernels(paged=True, exact=True)
    kernels.compile_elementwise()
block, n_kv, G, D = 64, 3, 3, 64                          # the embedded model's heads
chunk, splits = paged_kernel.exact_chunks(8192 // block + 1, block)  # its block tables: 8,192 positions + 1 block
positions = torch.tensor([100, 127, 128, 300, 511, 512, 700, 1000, 2047, 2100, 4000, 4095], device=device)
B, pool_blocks = positions.numel(), positions.numel() * 72 + 1
row = torch.arange(B, device=device) % 9                  # the decode row is this row of its request's verification
k_pool, v_pool = torch.randn(2, pool_blocks * block, n_kv, D, device=device).bfloat16().unbind(0)
table = torch.randperm(pool_blocks - 1, device=device)[:B * 72].view(B, 72)
q = torch.randn(B * 9, n_kv * G, D, device=device).bfloat16()


def paged_rows(Q: int, q_start, blocks: int, queries, with_lse: bool, requests: int = B):
    """The paged kernel's output for Q rows a request from q_start, over a table of `blocks` blocks."""
    q_valid = torch.ones(requests, Q, dtype=torch.bool, device=device)
    seen = torch.arange(blocks * block, device=device)[None, None]
    mask = seen <= (q_start[:requests, None] + torch.arange(Q, device=device))[:, :, None]
    block_mask = paged_kernel.paged_block_mask(table[:requests, :blocks].contiguous(), mask, q_start[:requests],
                                               q_valid, block, pool_blocks * block, G, chunk, splits,
                                               full_blocks=False)
    out = torch.zeros_like(queries[:requests * Q])
    q_index = torch.arange(requests * Q, device=device).view(requests, Q)
    paged_kernel._paged["attend"](out, queries, q_index, k_pool, v_pool, block_mask, with_lse)
    return out.view(requests, Q, n_kv * G, D)


decode_q = q.view(B, 9, -1, D)[torch.arange(B), row].contiguous()
decoded = paged_rows(1, positions, 64, decode_q, False)[:, 0]
verified = paged_rows(9, positions - row, 72, q, True)[torch.arange(B), row]
kind = f"paged kernel{' compiled' if device == 'cuda' else ''}, exact rows ({splits} chunks of {chunk} blocks)"
report(f"{kind}, a verification row against its decode row, contexts {positions.tolist()}",
       {p: torch.equal(a, b) for p, a, b in zip(positions.tolist(), verified, decoded)})
report(f"{kind}, decode rows in a batch of 3 against 12",
       {3: torch.equal(paged_rows(1, positions, 64, decode_q, False, requests=3)[:, 0], decoded[:3])})
x = torch.randn(10, 12, 64, device=device).bfloat16()
cos, sin = torch.randn(2, 10, 1, 32, device=device).unbind(0)
report("RoPE, rows 2 against 10", {2: torch.equal(model._ops["apply_rope"](x, cos, sin)[3:5],
                                                   model._ops["apply_rope"](x[3:5], cos[3:5], sin[3:5]))})
h, w = torch.randn(4608, 576, device=device).bfloat16(), torch.randn(576, device=device).bfloat16()
norm = model._ops["rms_norm"]
report("RMS norm, the first 2 rows of 3..4608 against 2 alone",
       {m: torch.equal(norm(h[:m], w, 1e-5)[:2], norm(h[:2], w, 1e-5)) for m in (3, 9, 10, 64, 512, 4608)})
