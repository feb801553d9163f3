"""`index_select` of rows on the CPU (one thread) by element type: bfloat16 and float32 rows against the same bytes
viewed as integers of the same size (int16, int32), at the two shapes the package gathers: the dense KV gather's
pool blocks (16 positions x 3 KV heads x 64, a request of 4,096 positions) and the draft buffers' copy (rows of 64).

    PYTHONPATH=. python benchmarks/cpu/gather_dtype.py

Twenty-second session: benchmarks/cpu/session22_gather_dtype.txt.
"""
import torch

from clock import ms  # benchmarks/cpu/clock.py


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print("| rows gathered | of a table | dtype | as itself, ms | as a same-size integer, ms |")
    print("|---|---|---|---:|---:|")
    for what, table_rows, width, n in (("pool blocks of a 4,096-position request", 8 * 257, 16 * 3 * 64, 256),
                                       ("8 requests' blocks", 8 * 257, 16 * 3 * 64, 2048),
                                       ("a draft step's lookups (rows of 64)", 30 * 9600 * 3, 64, 11520)):
        index = torch.randint(0, table_rows, (n,), generator=g)
        for dtype, integer in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            table = torch.randn(table_rows, width, generator=g).to(dtype)
            raw = table.view(integer)
            times = ms(lambda: table.index_select(0, index), 20), ms(lambda: raw.index_select(0, index), 20)
            assert torch.equal(raw.index_select(0, index).view(dtype), table.index_select(0, index))
            print(f"| {n} {what} | {table_rows} x {width} | {str(dtype)[6:]} | {times[0]:.3f} | {times[1]:.3f} |")


if __name__ == "__main__":
    main()
