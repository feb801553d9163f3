#!/bin/sh
# Session 3: the ideas left unmeasured in session 2, and the fall with context.
#   g_union_*   per-query-head selection (round-robin union of the group's heads, per_head_union.py), alone and
#               with lookup, on looping text and on text that cannot loop
#   h_share_*   the budget as a constant share of the context (12.5%, minimum 16) instead of max(128, 5%)
#   i_long_*    2,048 new tokens (contexts to ~2,150) at the default budget, text that cannot loop
# Two jobs at a time, one thread each.
cd "$(dirname "$0")/../.."
A="--threads 1 --num-prompts 4 --ignore-eos --temperatures 0"
S="--max-new-tokens 1024 --buckets 256,512,768,1024"
L="--max-new-tokens 2048 --buckets 256,512,768,1024,1536"
D=benchmarks/drafter
cat <<JOBS | OMP_NUM_THREADS=1 xargs -P 2 -I{} sh -c '{}'
.venv/bin/python $D/per_head_union.py $A $S --methods pillar,pillar-lookup --md-out $D/g_union_loop.md --json-out $D/g_union_loop.json 2> $D/g_union_loop.log
.venv/bin/python $D/per_head_union.py $A $S --no-repeat-ngram 6 --methods pillar,pillar-lookup --md-out $D/g_union_norep.md --json-out $D/g_union_norep.json 2> $D/g_union_norep.log
.venv/bin/python -m nano_sparsespec.acceptance $A $L --no-repeat-ngram 6 --methods pillar-lookup --md-out $D/i_long_lookup_norep.md --json-out $D/i_long_lookup_norep.json 2> $D/i_long_lookup_norep.log
.venv/bin/python -m nano_sparsespec.acceptance $A $S --no-repeat-ngram 6 --budget-ratios 0.125 --min-budgets 16 --methods pillar,pillar-lookup --md-out $D/h_share_norep.md --json-out $D/h_share_norep.json 2> $D/h_share_norep.log
.venv/bin/python -m nano_sparsespec.acceptance $A $L --no-repeat-ngram 6 --methods pillar --md-out $D/i_long_pillar_norep.md --json-out $D/i_long_pillar_norep.json 2> $D/i_long_pillar_norep.log
JOBS
