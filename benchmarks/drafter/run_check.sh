#!/bin/sh
# The chosen drafter by its name, with its defaults (8 lookup matches, lookups merged inside the budget's width),
# on the hardest greedy setting: the same numbers as `pillar-lookup:lookup_matches=8` in b_t0_norep are expected.
set -e
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=1 .venv/bin/python -m nano_sparsespec.acceptance --threads 1 --num-prompts 4 --max-new-tokens 1024 \
    --ignore-eos --buckets 256,512,768,1024 --temperatures 0 --no-repeat-ngram 6 --methods "pillar-lookup" \
    --md-out benchmarks/drafter/f_check_norep.md --json-out benchmarks/drafter/f_check_norep.json \
    2> benchmarks/drafter/f_check_norep.log
