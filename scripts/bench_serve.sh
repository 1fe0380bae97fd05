#!/usr/bin/env bash
# specgraph serve under load on one GPU (see scripts/gpu_setup.sh): for each of $RECIPES (the
# target alone, the dynamic tree, the dynamic tree under Bole's batch-wide budget) a server at the
# $SHAPE shape decoding up to $BATCH requests at once, and `loadgen` sending all 64 prompts of
# prompts_code.jsonl, streamed, $NEW_TOKENS tokens each, at each rate of $RATES requests/s
# (0: all at once); a JSON per recipe and rate in $OUT, and each server's log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
SHAPE=${SHAPE:-llama-3-8b}
BATCH=${BATCH:-16}
RATES=${RATES:-1 4 16 0}
NEW_TOKENS=${NEW_TOKENS:-128}
RECIPES=${RECIPES:-autoregressive dynamic budget}
PORT=${PORT:-8123}
mkdir -p "$OUT"
source scripts/gpu_setup.sh

for name in $RECIPES; do
  recipe=recipes/$name.yaml extra=()
  [ "$name" = budget ] && recipe=recipes/dynamic.yaml extra=(--set 'stages.1.verify.budget={epsilon: 0.1}')
  [ "$SHAPE" != "${SHAPE#qwen}" ] && extra+=(--set models.target.path=../.fixtures/hybrid)
  sg serve "$recipe" --widen "$SHAPE" --batch "$BATCH" --port "$PORT" "${extra[@]}" > "$OUT/serve-$SHAPE-$name.log" 2>&1 &
  server=$!
  until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2> /dev/null; do
    kill -0 "$server" 2> /dev/null || { echo "serve $name failed:"; tail -5 "$OUT/serve-$SHAPE-$name.log"; exit 1; }
    sleep 2
  done
  # untimed: every batch size's CUDA graphs captured (all at once, then draining)
  sg loadgen "http://127.0.0.1:$PORT" --prompts .fixtures/prompts_code.jsonl --requests $((2 * BATCH)) --max-tokens 16 > /dev/null
  for rate in $RATES; do
    pace=(--rate "$rate")
    [ "$rate" = 0 ] && pace=()
    sg loadgen "http://127.0.0.1:$PORT" --prompts .fixtures/prompts_code.jsonl --requests 64 --max-tokens "$NEW_TOKENS" \
      "${pace[@]}" --json "$OUT/loadgen-$SHAPE-$name-rate$rate.json"
  done
  kill -TERM "$server"
  wait "$server" || true
done
