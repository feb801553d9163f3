"""Research tools built on the engine: the benchmark and the acceptance sweep.

Not imported by the core.
"""
