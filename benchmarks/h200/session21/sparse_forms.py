"""A draft step's sparse attention at a Qwen3 shape, in forms that read the selected K/V where they lie in the pool
against the package's gather-then-matmul kernel, each layer replayed in a CUDA graph (as the engine runs it).

Why: on the fast path a Qwen3-8B-shape draft step (64 x 8,000, budget 400) spends 3.9 of its 11.6 ms of kernels in the
gather copy of the selected K/V (`pillar_attn.sparse_attention`'s index_select) and 1.3 ms more in the two matmuls
that read the copy (benchmarks/h200/session20/raw/draft_profile_ab_call7.txt). A form whose kernels load each selected
row once, from the pool, would read a third of those bytes.

    PYTHONPATH=. python benchmarks/h200/session21/sparse_forms.py [--drafts 64] [--kv-heads 8] [--group 4]
        [--head-dim 128] [--context 8000] [--width 432] [--layers 8]

Prints, per form: microseconds per layer, the step's 36-layer (or --model-layers) total, GB/s of the K/V it selects,
and the largest difference from the eager kernel.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import replay_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)


def fused_gs(q, k_rows, v_rows, index, valid):
    """Elementwise products and float32 sums, [B, n_kv, G, S] logits: each gather becomes an indirect load inside the
    reduction that consumes it (the form session 6 measured slower at the embedded model's shape)."""
    B, H, D = q.shape
    n_kv = index.shape[1]
    queries = q.view(B, n_kv, H // n_kv, 1, D).float() * D ** -0.5                    # [B, n_kv, G, 1, D]
    keys = pillar_attn.gather_rows(k_rows, index)[:, :, None].float()                   # [B, n_kv, 1, S, D]
    logits = (queries * keys).sum(-1)                                                  # [B, n_kv, G, S]
    probs = logits.masked_fill(~valid[:, None, None], float("-inf")).softmax(dim=-1)
    values = pillar_attn.gather_rows(v_rows, index)[:, :, None].float()                 # [B, n_kv, 1, S, D]
    return (probs[..., None] * values).sum(-2).to(q.dtype).reshape(B, H, D)


def fused_sg(q, k_rows, v_rows, index, valid):
    """As `fused_gs` with the G query heads of a KV head next to each other ([B, n_kv, S, G] logits), so the G
    products that read one key row sit in one block of the reduction."""
    B, H, D = q.shape
    n_kv = index.shape[1]
    queries = q.view(B, n_kv, 1, H // n_kv, D).float() * D ** -0.5                    # [B, n_kv, 1, G, D]
    keys = k_rows[index][:, :, :, None].float()                                         # [B, n_kv, S, 1, D]
    logits = (queries * keys).sum(-1)                                                  # [B, n_kv, S, G]
    probs = logits.masked_fill(~valid[:, None, :, None], float("-inf")).softmax(dim=2)
    values = v_rows[index][:, :, :, None].float()                                       # [B, n_kv, S, 1, D]
    return (probs[..., None] * values).sum(2).to(q.dtype).reshape(B, H, D)             # [B, n_kv, G, D]


def logits_fused(q, k_rows, v_rows, index, valid):
    """Logits as `fused_sg` (keys read in place), values gathered and multiplied as the package does."""
    B, H, D = q.shape
    n_kv = index.shape[1]
    queries = q.view(B, n_kv, 1, H // n_kv, D).float() * D ** -0.5
    logits = (queries * k_rows[index][:, :, :, None].float()).sum(-1)                  # [B, n_kv, S, G]
    probs = logits.masked_fill(~valid[:, None, :, None], float("-inf")).softmax(dim=2)
    values = pillar_attn.gather_rows(v_rows, index)                                     # [B, n_kv, S, D]
    return torch.matmul(probs.transpose(2, 3).to(v_rows.dtype), values).reshape(B, H, D)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--drafts", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--width", type=int, default=432)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model-layers", type=int, default=36)
    p.add_argument("--forms", default="eager,compiled,fused_gs,fused_sg,logits_fused,fused_sg_cdt,autotune")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    B, n_kv, G, D, S = args.drafts, args.kv_heads, args.group, args.head_dim, args.width
    slots = B * (args.context + 16)
    torch.manual_seed(0)
    k_pool = torch.randn(args.layers, slots * n_kv, D, device=device, dtype=dtype)      # one pool per layer
    v_pool = torch.randn(args.layers, slots * n_kv, D, device=device, dtype=dtype)
    q = torch.randn(B, n_kv * G, D, device=device, dtype=dtype)
    # per (layer, draft, KV head): S distinct positions of the draft's own request, sorted, as selections are
    chosen = torch.rand(args.layers, B, n_kv, args.context, device=device).topk(S, dim=-1).indices.sort(-1).values
    own = torch.arange(B, device=device)[None, :, None, None] * (args.context + 16)
    index = (own + chosen) * n_kv + torch.arange(n_kv, device=device)[None, None, :, None]   # [layers, B, n_kv, S]
    valid = torch.arange(S, device=device)[None] < torch.randint(S - 16, S + 1, (B, 1), device=device)   # [B, S]

    def compiled(fn, **options):
        return torch.compile(fn, dynamic=False, **options)

    forms = {"eager": lambda: pillar_attn.sparse_attention,
             "compiled": lambda: compiled(pillar_attn.sparse_attention),
             "fused_gs": lambda: compiled(fused_gs), "fused_sg": lambda: compiled(fused_sg),
             "logits_fused": lambda: compiled(logits_fused)}
    reference = torch.stack([pillar_attn.sparse_attention(q, k_pool[i], v_pool[i], index[i], valid)
                             for i in range(args.layers)]).float()
    selected = B * n_kv * S * D * 2 * dtype.itemsize            # K and V bytes one layer selects
    print(f"{B} drafts x {n_kv} KV heads x {G} query heads each, head_dim {D}, {S} entries, pool {args.context} "
          f"positions per draft, {args.layers} layers; {selected / 1e6:.1f} MB of K/V selected per layer")
    for name in args.forms.split(","):
        torch._dynamo.reset()
        if name == "fused_sg_cdt":
            inductor_config.coordinate_descent_tuning = True
            kernel = compiled(fused_sg)
        elif name == "autotune":     # matmul templates autotuned, the gathers fused in as prologues where they can be
            inductor_config.coordinate_descent_tuning = False
            kernel = compiled(pillar_attn.sparse_attention, mode="max-autotune-no-cudagraphs")
        else:
            kernel = forms[name]()

        def step():
            return [kernel(q, k_pool[i], v_pool[i], index[i], valid) for i in range(args.layers)]
        try:
            ms = replay_ms(step)
            error = (torch.stack(step()).float() - reference).abs().max().item()
        except Exception as e:        # a form the compiler cannot build here: say so, go on
            print(f"  {name:14s} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        per_layer = ms / args.layers
        print(f"  {name:14s} {per_layer * 1e3:7.1f} us per layer  {per_layer * args.model_layers:6.2f} ms per "
              f"{args.model_layers} layers  {selected / per_layer / 1e6:7.1f} GB/s of selected K/V  "
              f"max |diff| vs eager {error:.2e}")


if __name__ == "__main__":
    main()
