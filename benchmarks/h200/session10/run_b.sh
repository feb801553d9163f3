# Session 10, a call on a machine where the first call copied part_aa and installed the wheels: rebuild the GGUF
# (once per machine), then what the environment asks for: PYTEST=1 the CUDA tests, SPLIT="mode ..." engine_split,
# TEMPS="0.6 0" the rows (ROWS, default plain,+async; NREQ requests (128) x TOKENS new tokens (2048) through
# 128 slots; EXTRA: more bench options, e.g. "--stride 4"; TAG: a suffix for the output names).
set -o pipefail
if [ ! -f /root/m/smollm2.gguf ]; then
  cp .gpu/part_ab /root/m/ && cat /root/m/part_aa /root/m/part_ab > /root/m/smollm2.gguf
  echo "$(cat .gpu/sha256)  /root/m/smollm2.gguf" | sha256sum -c || exit 1
fi
export PYTHONPATH=$PWD:/root/site NANO_SPARSESPEC_CACHE=/root/cache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
call=${CALL:-x}
G=/root/m/smollm2.gguf
if [ -n "$PYTEST" ]; then
  python -m pytest -q -x tests/test_cuda_graphs.py tests/test_verifier.py tests/test_engine.py \
    -k "cuda or Cuda or CUDA or graph or fetch" 2>&1 | tail -2 | tee $OUT/pytest_cuda_call$call.txt
fi
if [ -n "$SPLIT" ]; then
  python benchmarks/h200/session6/engine_split.py --gguf $G --tokens 1024 --warm-up 24 $SPLIT 2>&1 \
    | grep -E "tok/s|ms/step|Error|error" | tee $OUT/engine_split_call$call.txt
fi
for T in $TEMPS; do
  name=rows_call${call}_b128_n${NREQ:-128}_${TOKENS:-2048}_t${T}_kv1${TAG}
  python -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --compile --batch-size 128 \
    --num-requests ${NREQ:-128} --max-new-tokens ${TOKENS:-2048} --ignore-eos --temperature $T --kv-fraction 1 --rows ${ROWS:-plain,+async} \
    $EXTRA --json-out $OUT/$name.json --md-out $OUT/$name.md --plot-out $OUT/$name.png 2>&1 | grep -v -i warn \
    | grep -v -i "online softmax\|split the reduction\|important use case\|^softmax\|^$" | tee $OUT/$name.log
done
