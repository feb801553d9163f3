"""Prompt-lookup (n-gram) drafting: the vLLM-ngram baseline drafter.

Owns `propose`: find the most recent earlier occurrence of the request's last n tokens (longest n
first) and propose the tokens that followed it. It runs on the CPU and costs no model step; the
proposal is deterministic, so the verifier treats its draft distribution as one-hot.
Must not touch the model, the KV cache or sampling.
"""
from __future__ import annotations


def propose(tokens: list[int], max_drafts: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `max_drafts` tokens that followed the latest earlier match of the last n tokens;
    n runs from `ngram_max` down to `ngram_min`; the longest matching n wins."""
    if max_drafts <= 0:
        return []
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = tokens[-n:]
        # latest match first, never the suffix itself
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_drafts]
    return []
