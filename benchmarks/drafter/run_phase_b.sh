#!/bin/sh
# Phase B of the drafter ablation (see README.md): non-looping text (repeated 6-grams banned) for the ideas that
# helped greedy looping text and two combinations, then the ideas that did not, then the combinations greedy.
# score_agg / rejected_weight / recent_share were dropped afterwards: `git apply --3way dropped_options.patch` first.
set -e
cd "$(dirname "$0")/../.."
COMMON="--threads 1 --num-prompts 4 --max-new-tokens 1024 --ignore-eos --buckets 256,512,768,1024"
run() {   # run NAME ARGS...: one acceptance sweep, its table/record/log under benchmarks/drafter/
    name=$1; shift
    OMP_NUM_THREADS=1 .venv/bin/python -m nano_sparsespec.acceptance $COMMON "$@" \
        --md-out benchmarks/drafter/$name.md --json-out benchmarks/drafter/$name.json 2> benchmarks/drafter/$name.log
}
run b_t0_norep --temperatures 0 --no-repeat-ngram 6 \
    --methods "pillar,pillar-lookup:lookup_matches=4,pillar-lookup:lookup_matches=8,pillar:recent_share=0.25,pillar-lookup:lookup_matches=8:recent_share=0.25,pillar-lookup:lookup_matches=16,streaming"
run c_t0_norep --temperatures 0 --no-repeat-ngram 6 \
    --methods "pillar-lookup:lookup_matches=2,pillar:score_agg=max,pillar:rejected_weight=0"
run d_t0_loop --temperatures 0 \
    --methods "pillar-lookup:lookup_matches=8:recent_share=0.25,pillar-lookup:lookup_matches=16"
