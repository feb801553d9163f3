"""The draft step's sparse attention on the CPU (one thread, bfloat16), over the first N of C columns of the draft
buffers' rows (a view whose matrices lie apart) and over packed copies of them.

    PYTHONPATH=. python benchmarks/cpu/strided_matmul.py

Twenty-second session: benchmarks/cpu/session22_strided_matmul.txt (`sparse_attention` before and after it packs
the keys on the CPU).
"""
import torch

from clock import ms  # benchmarks/cpu/clock.py
from nano_sparsespec import pillar_attn


def main():
    torch.set_num_threads(1)
    rows, n_kv, heads, D = 9, 3, 9, 64                  # the embedded model's layer, batch 8 (+ the padding row)
    print(f"rows {rows}, KV heads {n_kv}, query heads {heads}, head_dim {D}, bfloat16, us per call")
    print("| N | C | q @ k^T view | q @ k^T packed | copy k | p @ v view | p @ v packed | sparse_attention of views |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for N, C in ((152, 152), (152, 240), (216, 240), (152, 440), (232, 440)):
        k_buf, v_buf = (torch.randn(rows, n_kv, C, D, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(rows, heads, D, dtype=torch.bfloat16)
        grouped = q.view(rows, n_kv, heads // n_kv, D)
        probs = torch.randn(rows, n_kv, heads // n_kv, N, dtype=torch.bfloat16)
        valid = torch.rand(rows, n_kv, N) < 0.9
        k, v = k_buf[:, :, :N], v_buf[:, :, :N]
        kc, vc = k.contiguous(), v.contiguous()
        times = [ms(lambda: torch.matmul(grouped, k.transpose(-1, -2)), 400) * 1e3,
                 ms(lambda: torch.matmul(grouped, kc.transpose(-1, -2)), 400) * 1e3,
                 ms(lambda: k.contiguous(), 400) * 1e3,
                 ms(lambda: torch.matmul(probs, v), 400) * 1e3,
                 ms(lambda: torch.matmul(probs, vc), 400) * 1e3,
                 ms(lambda: pillar_attn.sparse_attention(q, k, v, valid), 400) * 1e3]
        print(f"| {N} | {C} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
