"""Tutorials: from naive speculative decoding to full SparseSpec, one runnable script per step.

Run one with `python -m tutorials.00_memory_bound` (add `--quick` for a seconds-long run on a tiny random model);
`tutorials/README.md` lists them in order. Exercises live in `tutorials/exercises/`; `python -m tutorials.check N`
checks yours.
"""
