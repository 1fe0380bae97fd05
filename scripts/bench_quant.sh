#!/usr/bin/env bash
# Quantized weights on one GPU (see scripts/gpu_setup.sh): the kernel micro-benchmark (scripts/bench_qlinear.py),
# then at $SHAPE the static tree recipe (recipes/tree.yaml: the 1B-shape drafter) against `ar`, once per scheme
# of $SCHEMES ("bf16" for none), target and drafter quantized alike (--widen SHAPE:SCHEME): one bench process per
# scheme, all prompts. Each call of the device should take one shape and a few schemes (about 3 min a scheme at
# llama-3-8b): e.g. `SCHEMES="bf16 w4a16 fp8" bash scripts/bench_quant.sh`, then
# `SHAPE=llama-3-70b SCHEMES=w4a16 KERNELS=0 bash scripts/bench_quant.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-64}
NEW_TOKENS=${NEW_TOKENS:-128}
SHAPE=${SHAPE:-llama-3-8b}
SCHEMES=${SCHEMES:-bf16 w4a16 fp8}
mkdir -p "$OUT"
source scripts/gpu_setup.sh

if [ "${KERNELS:-1}" = 1 ]; then
  python3 scripts/bench_qlinear.py | tee "$OUT/qlinear.txt"
fi
head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
for scheme in $SCHEMES; do
  widen=$SHAPE
  [ "$scheme" = bf16 ] || widen="$SHAPE:$scheme"
  sg bench recipes/tree.yaml --prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats 1 --warmup 4 \
     --widen "$widen" --baselines ar --json "$OUT/$SHAPE-$scheme-tree.json"
done
