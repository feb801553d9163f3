#!/bin/sh
# Phase C of the drafter ablation (see README.md): sampling at T=0.6, the chosen drafter, the previous default
# and the baselines.
set -e
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=1 .venv/bin/python -m nano_sparsespec.acceptance --threads 1 --num-prompts 4 --max-new-tokens 1024 \
    --ignore-eos --buckets 256,512,768,1024 --temperatures 0.6 \
    --methods "pillar-lookup:lookup_matches=8,pillar-lookup:lookup_matches=4,pillar,streaming" \
    --md-out benchmarks/drafter/e_t06.md --json-out benchmarks/drafter/e_t06.json 2> benchmarks/drafter/e_t06.log
