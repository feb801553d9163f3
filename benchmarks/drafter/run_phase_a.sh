#!/bin/sh
# Phase A of the drafter ablation (see README.md): each idea alone, greedy, looping text.
# (This script first also ran the same methods with --no-repeat-ngram 6; that run failed at start-up with a TypeError
# from an unrelated change in flight, and its configurations were run again by run_phase_b.sh.)
# score_agg / rejected_weight / recent_share were dropped afterwards: `git apply --3way dropped_options.patch` first.
set -e
cd "$(dirname "$0")/../.."
COMMON="--threads 1 --num-prompts 4 --max-new-tokens 1024 --ignore-eos --buckets 256,512,768,1024 --temperatures 0"
METHODS="pillar,streaming,pillar-lookup:lookup_matches=2,pillar-lookup:lookup_matches=4,pillar-lookup:lookup_matches=8,pillar:score_agg=max,pillar:rejected_weight=0,pillar:recent_share=0.25"
OMP_NUM_THREADS=1 .venv/bin/python -m nano_sparsespec.acceptance $COMMON --methods "$METHODS" \
    --md-out benchmarks/drafter/a_t0_loop.md --json-out benchmarks/drafter/a_t0_loop.json 2> benchmarks/drafter/a_t0_loop.log
