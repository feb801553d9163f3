"""A draft step's sparse attention, 30 layers replayed as one CUDA graph (as the engine runs it with --cuda-graphs):
the eager kernel (`pillar_attn.sparse_attention`: index_select gathers + matmuls), the compiled fused kernel that
`--compile` used until this session (`sparse_attention_fused`, kept here), and the compiled matmul form (adopted).

Why: torch.profiler over steady-state engine steps (engine_profile.py, raw/profile_call6.txt) put the two Triton
reductions of the compiled fused kernel at 7.1 of a balanced step's 12.4 ms of GPU time. In a graph the eager form's
extra launches cost nothing, so its library kernels may win.

Usage: python benchmarks/h200/session6/sparse_kernel.py [DRAFTS [WIDTH [CONTEXT [DEVICE]]]]
(defaults 112 drafts x 160 gathered entries, a pool of 128 requests x 2,048 positions per layer)."""
import sys
import time
from pathlib import Path

import torch

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import replay_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)

drafts = int(sys.argv[1]) if len(sys.argv) > 1 else 112
width = int(sys.argv[2]) if len(sys.argv) > 2 else 160
context = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cuda")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
layers, n_kv, G, D = 30, 3, 3, 64
slots = 128 * context
torch.manual_seed(0)
k_pool = torch.randn(layers, slots * n_kv, D, device=device, dtype=dtype)                  # one pool per layer
v_pool = torch.randn(layers, slots * n_kv, D, device=device, dtype=dtype)
q = torch.randn(drafts, n_kv * G, D, device=device, dtype=dtype)
index = torch.randint(0, slots, (layers, drafts, 1, width), device=device) * n_kv \
    + torch.arange(n_kv, device=device)[None, None, :, None]                               # [L, B, n_kv, S]
valid = torch.arange(width, device=device)[None] < torch.randint(width // 2, width + 1, (drafts, 1), device=device)


def sparse_attention_fused(q, k_rows, v_rows, index, valid):
    """The package's compiled sparse kernel until session 6: `sparse_attention` as elementwise products and float32
    sums, so that compiled each gather becomes an indirect load inside the reduction that consumes it (session 4
    measured it faster than gathers + matmuls in one layer outside a graph, step_anatomy.py sparse)."""
    B, H, D = q.shape
    n_kv = index.shape[1]
    queries = q.view(B, n_kv, H // n_kv, 1, D).float()                                 # [B, n_kv, G, 1, D]
    keys = pillar_attn.gather_rows(k_rows, index)[:, :, None].float()                              # [B, n_kv, 1, S, D]
    logits = (queries * keys).sum(-1) * D ** -0.5                                      # [B, n_kv, G, S]
    probs = logits.masked_fill(~valid[:, None, None], float("-inf")).softmax(dim=-1)
    values = pillar_attn.gather_rows(v_rows, index)[:, :, None].float()                            # [B, n_kv, 1, S, D]
    return (probs[..., None] * values).sum(-2).to(q.dtype).reshape(B, H, D)


def step(kernel):
    return [kernel(q, k_pool[i], v_pool[i], index[i], valid) for i in range(layers)]


def timed(kernel, reps=20) -> float:
    """Milliseconds per step (30 layers): a CUDA graph replayed (wall clock, eager, on a CPU)."""
    step(kernel)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            step(kernel)
        return (time.perf_counter() - start) / reps * 1e3
    return replay_ms(lambda: step(kernel), reps)


reference = torch.stack(step(pillar_attn.sparse_attention)).float()
kernels = {"eager sparse_attention": pillar_attn.sparse_attention,
           "compiled sparse_attention_fused": torch.compile(sparse_attention_fused, dynamic=True),
           "compiled sparse_attention": torch.compile(pillar_attn.sparse_attention, dynamic=True)}
gathered = drafts * n_kv * width * D * 2 * dtype.itemsize        # K and V bytes a layer gathers
print(f"{drafts} drafts x {width} entries, {layers} layers, {device} {dtype}")
for name, kernel in kernels.items():
    ms = timed(kernel)
    error = (torch.stack(step(kernel)).float() - reference).abs().max().item()
    print(f"  {name:34s} {ms:7.3f} ms per step  {ms / layers * 1e3:6.1f} us per layer  "
          f"{gathered * layers / ms / 1e6:7.1f} GB/s of gathered K/V  max |diff| vs eager {error:.2e}")
