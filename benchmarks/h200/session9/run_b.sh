# Session 9, the second call on a fresh machine (after the first copied part_aa and installed the gguf wheel):
# rebuild the GGUF, run the CUDA tests, time the engine's parts (engine_split), then the rows.
set -o pipefail
cp .gpu/part_ab /root/m/ && cat /root/m/part_aa /root/m/part_ab > /root/m/smollm2.gguf
echo "$(cat .gpu/sha256)  /root/m/smollm2.gguf" | sha256sum -c || exit 1
export PYTHONPATH=$PWD:/root/site NANO_SPARSESPEC_CACHE=/root/cache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
call=${CALL:-x}
G=/root/m/smollm2.gguf
python -m pytest -q -x tests/test_cuda_graphs.py tests/test_verifier.py -k "cuda or Cuda or CUDA or graph" 2>&1 \
  | tail -2 | tee $OUT/pytest_cuda_call$call.txt
if [ -n "$SPLIT" ]; then
  python benchmarks/h200/session6/engine_split.py --gguf $G --tokens 1024 --warm-up 24 $SPLIT 2>&1 \
    | grep -E "tok/s|ms/step" | tee $OUT/engine_split_call$call.txt
fi
for T in ${TEMPS:-0.6 0}; do
  name=rows_call${call}_b128_n128_2048_t${T}_kv1
  python -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --compile --batch-size 128 \
    --num-requests 128 --max-new-tokens 2048 --ignore-eos --temperature $T --kv-fraction 1 --rows ${ROWS:-plain,+async} \
    --json-out $OUT/$name.json --md-out $OUT/$name.md --plot-out $OUT/$name.png 2>&1 | grep -v -i warn \
    | grep -v -i "online softmax\|split the reduction\|important use case\|^softmax\|^$" | tee $OUT/$name.log
done
