#!/usr/bin/env bash
# Session 3 on the H200. Usage (on the device; the rows need the model staged, see ../shared/GPU.md):
#   bash benchmarks/h200/session3/run.sh modes                  kernel choices behind --compile (random weights)
#   bash benchmarks/h200/session3/run.sh rows T [--compile]     plain and the SparseSpec ablation, batch 128 x 2,048
#   bash benchmarks/h200/session3/run.sh lookup T [--compile]   the same with the pillar rows on pillar-lookup
# The bench writes its JSON / markdown / PNG after every row, so a run cut short keeps the rows it finished.
export PYTHONPATH=$PWD:/root/site NANO_SPARSESPEC_CACHE=/root/cache
G=/root/m/smollm2.gguf
phase=$1 T=$2 C=$3
tag=${C:+_compile}
bench() {   # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs $C --batch-size 128 \
     --max-new-tokens 2048 --ignore-eos --temperature "$T" "$@" \
     --json-out "$OUT/$name.json" --md-out "$OUT/$name.md" --plot-out "$OUT/$name.png" 2>&1 | grep -v Warn | tail -14
}
case "$phase" in
modes)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  timeout 280 python3 benchmarks/h200/session3/step_modes.py 128 2048 2>&1 | grep -v Warn | tee "$OUT/step_modes.txt"
  ;;
rows)
  bench "rows_b128_2048_t$T$tag" 540 --rows plain,pillar-naive,+balanced,+offload,+async
  ;;
lookup)
  bench "lookup_b128_2048_t$T$tag" 540 --pillar-method pillar-lookup --rows plain,pillar-naive,+async,streaming
  ;;
esac
