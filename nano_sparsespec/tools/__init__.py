"""Research tools built on the engine: the benchmark and the acceptance sweep (not imported by the core)."""
