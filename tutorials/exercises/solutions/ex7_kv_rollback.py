"""Reference solution of exercise 7 (rolling the KV back after a rejection)."""


def rollback(block_table: list[int], length: int, block_size: int, n_rejected: int) -> tuple[int, list[int], list[int]]:
    if not 0 <= n_rejected <= length:
        raise ValueError(f"cannot forget {n_rejected} of {length} cached positions")
    new_length = length - n_rejected
    keep = -(-new_length // block_size)                                       # blocks still holding a position
    return new_length, block_table[:keep], block_table[keep:]
