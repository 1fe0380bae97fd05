#!/usr/bin/env bash
# The disaggregated executor (SwiftSpec) on a 2-GPU machine (see scripts/gpu_setup.sh): the
# Llama-3-8B-shape target on cuda:0, the drafter on cuda:1 (`draft` widened to Llama-3.2-1B, `mid`
# to 3B), against the same recipe on the serial executor (both stages on cuda:0), `ar` and, where
# BASELINES names it, transformers `generate`. One JSON per drafter in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-64}
NEW_TOKENS=${NEW_TOKENS:-128}
REPEATS=${REPEATS:-1}
DRAFTERS=${DRAFTERS:-draft mid}
BASELINES=${BASELINES:-serial,ar}
GROW_DRAFT=${GROW_DRAFT:-}  # e.g. "{steps: 4, leaves: 16}"; empty: the recipe's defaults
GROW_MID=${GROW_MID:-}
TARGET=${TARGET:-llama}     # llama (the 8B shape) or hybrid (.fixtures/hybrid at the Qwen3.5-9B shape)
mkdir -p "$OUT"
source scripts/gpu_setup.sh

head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
for drafter in $DRAFTERS; do
  path=models/draft grow=$GROW_DRAFT
  [ "$drafter" = mid ] && path=../.fixtures/mid grow=$GROW_MID
  extra=() shape=llama-3-8b
  [ -n "$grow" ] && extra+=(--set "stages.0.grow=$grow")
  [ "$TARGET" = hybrid ] && shape=qwen3.5-9b extra+=(--set models.target.path=../.fixtures/hybrid)
  sg bench recipes/disaggregated.yaml --prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" \
    --widen "$shape" --set "models.draft.path=$path" --set 'stages.0.devices=[cuda:1]' --set 'stages.1.devices=[cuda:0]' \
    "${extra[@]}" --baselines "$BASELINES" --json "$OUT/$shape-disaggregated-$drafter.json"
done
