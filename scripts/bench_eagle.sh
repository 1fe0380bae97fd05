#!/usr/bin/env bash
# EAGLE-3 heads on one GPU (see scripts/gpu_setup.sh), at the $SHAPE shape: the shipped head
# (recipes/eagle3.yaml: models/eagle3 widened to a head of the target's shape) against the 1B
# drafter (models/draft widened to Llama-3.2-1B) on the same static and dynamic trees, and `ar`:
# two bench processes (each loads its drafter once; the other tree runs as a recipe baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-64}
NEW_TOKENS=${NEW_TOKENS:-128}
SHAPE=${SHAPE:-llama-3-8b}
mkdir -p "$OUT"
source scripts/gpu_setup.sh

head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
common=(--prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats 1 --warmup 4 --widen "$SHAPE")
# the head on tree.yaml's static tree (model paths made absolute: the file lives in $OUT)
sed -e 's/^name: eagle3/name: eagle3-static/' -e "s#path: models/#path: $PWD/recipes/models/#" \
    -e 's#{shape: dynamic, width: 4, depth: 5, nodes: 24}#{shape: static, branching: [3, 2, 1, 1]}#' \
    recipes/eagle3.yaml > "$OUT/eagle3-static.yaml"
sg bench recipes/eagle3.yaml "${common[@]}" --baselines "ar,$OUT/eagle3-static.yaml" --json "$OUT/$SHAPE-eagle3.json"
sg bench recipes/tree.yaml "${common[@]}" --baselines recipes/dynamic.yaml --json "$OUT/$SHAPE-1b.json"
