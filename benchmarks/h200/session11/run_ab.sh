# Session 11: one call compares versions of the engine on the same machine (machine instances differ by ~30% in
# host speed, so figures from different calls do not compare). A version other than this checkout ("head") is an
# extracted commit, carried with the call (carry: .gpu/NAME):
#   mkdir -p .gpu/NAME && git archive <commit> nano_sparsespec benchmarks/h200/session6 | tar -x -C .gpu/NAME
# Rebuilds the GGUF once per machine (part_aa staged by an earlier call, part_ab carried), then: PYTEST=1 the CUDA
# tests of this checkout; SPLIT="mode ..." engine_split for each version of ORDER (default "base head"), each in its
# own process; ROWS_T="0.6" the rows of this checkout (ROWS, NREQ, TOKENS, EXTRA as in session10/run_b.sh);
# PROFILE="mode ..." (session 12) engine_profile.py of this checkout with PROFILE_FLAGS (default --by-source: eager
# steps, kernels grouped by the package functions that launched them; "" profiles the CUDA-graph steps), over
# PROFILE_TOKENS new tokens (default 1024) from step PROFILE_FIRST (default 520; session 20).
set -o pipefail
if [ ! -f /root/m/smollm2.gguf ]; then
  cp .gpu/part_ab /root/m/ && cat /root/m/part_aa /root/m/part_ab > /root/m/smollm2.gguf
  echo "$(cat .gpu/sha256)  /root/m/smollm2.gguf" | sha256sum -c || exit 1
fi
export NANO_SPARSESPEC_CACHE=/root/cache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
call=${CALL:-x}
G=/root/m/smollm2.gguf
HEAD=$PWD
if [ -n "$PYTEST" ]; then
  PYTHONPATH=$HEAD:/root/site python -m pytest -q -x tests/test_cuda_graphs.py tests/test_verifier.py \
    tests/test_pillar_attn.py tests/test_engine.py -k "cuda or Cuda or CUDA or graph or fetch" 2>&1 | tail -2 | tee $OUT/pytest_cuda_call$call.txt
fi
if [ -n "$SPLIT" ]; then
  for version in ${ORDER:-base head}; do
    root=$HEAD; [ $version != head ] && root=$HEAD/.gpu/$version
    (cd $root && PYTHONPATH=$root:/root/site python benchmarks/h200/session6/engine_split.py --gguf $G \
      --tokens ${SPLIT_TOKENS:-1024} --warm-up 24 $SPLIT 2>&1 | grep -E "tok/s|ms/step|Error|error") \
      | tee $OUT/engine_split_${version}_call$call.txt
  done
fi
if [ -n "$PROFILE" ]; then
  (cd benchmarks/h200/session6 && PYTHONPATH=$HEAD:/root/site python engine_profile.py --gguf $G --batch 128 \
    --tokens ${PROFILE_TOKENS:-1024} --first ${PROFILE_FIRST:-520} --steps 20 --rows 40 ${PROFILE_FLAGS---by-source} $PROFILE 2>&1 | grep -v -i warn) \
    | tee $OUT/profile_call$call.txt
fi
for T in $ROWS_T; do
  name=rows_call${call}_b128_n${NREQ:-128}_${TOKENS:-2048}_t${T}_kv1${TAG}
  PYTHONPATH=$HEAD:/root/site python -m nano_sparsespec.bench --gguf $G --device cuda --cuda-graphs --compile \
    --batch-size 128 --num-requests ${NREQ:-128} --max-new-tokens ${TOKENS:-2048} --ignore-eos --temperature $T \
    --kv-fraction 1 --rows ${ROWS:-plain,+async} $EXTRA --json-out $OUT/$name.json --md-out $OUT/$name.md \
    --plot-out $OUT/$name.png 2>&1 | grep -v -i warn \
    | grep -v -i "online softmax\|split the reduction\|important use case\|^softmax\|^$" | tee $OUT/$name.log
done
