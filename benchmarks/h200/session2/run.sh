#!/usr/bin/env bash
# Session 2 on the H200: the CUDA-graph path. Usage (on the device, model staged): bash benchmarks/h200/session2/run.sh PHASE
set -x
export PYTHONPATH=$PWD:/root/site NANO_SPARSESPEC_CACHE=/root/cache
G=/root/m/smollm2.gguf
case "$1" in
quick)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py -k cuda 2>&1 | tail -5
  timeout 300 python3 -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --batch-size 128 \
     --max-new-tokens 256 --ignore-eos --rows plain,pillar-naive,+balanced,+async \
     --json-out $OUT/quick_b128_256.json --md-out $OUT/quick_b128_256.md 2>&1 | tail -30
  ;;
rows)   # the workload: batch 128 x 2,048 new tokens, T = 0.6 then 0, every row of ours
  for T in 0.6 0; do
    timeout 280 python3 -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --batch-size 128 \
       --max-new-tokens 2048 --ignore-eos --temperature $T --rows plain,ngram,streaming,pillar-naive,+balanced,+offload,+async \
       --json-out $OUT/graphs_b128_2048_t$T.json --md-out $OUT/graphs_b128_2048_t$T.md --plot-out $OUT/graphs_b128_2048_t$T.png 2>&1 | grep -v Warn | tail -16
  done
  ;;
final)   # the rows with the whole fast path (graphs + compile), then the step split
  timeout 300 python3 -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --compile --batch-size 128 \
     --max-new-tokens 2048 --ignore-eos --temperature 0.6 --rows plain,streaming,pillar-naive,+balanced,+async \
     --json-out $OUT/fast_b128_2048_t0.6.json --md-out $OUT/fast_b128_2048_t0.6.md --plot-out $OUT/fast_b128_2048_t0.6.png 2>&1 | grep -v Warn | tail -14
  timeout 110 python3 -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --compile --batch-size 128 \
     --max-new-tokens 2048 --ignore-eos --temperature 0 --rows plain,+async \
     --json-out $OUT/fast_b128_2048_t0.json --md-out $OUT/fast_b128_2048_t0.md 2>&1 | grep -v Warn | tail -8
  timeout 120 python3 benchmarks/h200/session2/step_split.py $G 128 2048 compile 2>&1 | grep "^T=\|compile=" | tee $OUT/step_split.txt
  ;;
esac
