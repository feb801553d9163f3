"""Classroom exercises: write the core rules of SparseSpec yourself, then check them against the package.

    ex1_greedy_accept.py       the greedy acceptance rule (longest matching prefix + the verifier's token)
    ex2_rejection_sampling.py  lossless rejection sampling for one request
    ex3_critical_tokens.py     PillarAttn's critical-token top-k, with GQA averaging
    ex4_balanced_phases.py     the phase clock: balanced verify-slot assignment and the per-step action
    ex5_offload_victim.py      which request leaves the device when the KV pool is full
    ex6_sparse_attention.py    a draft token's attention over its selected positions, with GQA (gather + attend)
    ex7_kv_rollback.py         rolling the paged KV cache back after a rejection: new length, blocks freed

Each file has a function whose docstring is the contract (what to compute, not how) and whose body raises
NotImplementedError. Replace the body, then run `python -m tutorials.check N`: a failure says which case, head,
position or request went wrong. Reference solutions live in `solutions/` (look after you tried);
`python -m tutorials.check N --solution` runs the checker on them.
"""
