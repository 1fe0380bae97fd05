#!/usr/bin/env bash
# Run specgraph bench on a fresh GPU machine that has only this repository (see scripts/gpu_setup.sh).
# Results (JSON per benchmark, and a log) go to $OUT (default: bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-8}
NEW_TOKENS=${NEW_TOKENS:-128}
REPEATS=${REPEATS:-1}
SHAPE=${SHAPE:-llama-3-8b}
mkdir -p "$OUT"
source scripts/gpu_setup.sh

head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
common=(--prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --widen "$SHAPE")
mid=(--set models.draft.path=../.fixtures/mid)

python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_gpu.py || echo "GPU TESTS FAILED"
python3 scripts/bench_attention.py --json "$OUT/attention.json"
sg bench recipes/tree.yaml "${common[@]}" --baselines hf,hf-assisted,ar --json "$OUT/$SHAPE-tree-draft.json"
sg bench recipes/chain.yaml "${common[@]}" --baselines ar --json "$OUT/$SHAPE-chain-draft.json"
sg bench recipes/dynamic.yaml "${common[@]}" "${mid[@]}" --baselines ar --json "$OUT/$SHAPE-dynamic-mid.json"
# the hybrid (Qwen3.5) target at the Qwen3.5-9B shape (transformers' assisted generation refuses hybrids)
sg bench recipes/hybrid.yaml --prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" \
  --widen qwen3.5-9b --set models.target.path=../.fixtures/hybrid --baselines ar,hf --json "$OUT/qwen3.5-9b-hybrid-draft.json"
# Llama-3-70B on two GPUs: both stages tensor-parallel over cuda:0 and cuda:1 (one process per GPU)
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  sg bench recipes/tree.yaml --prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" \
    --widen llama-3-70b --set 'stages.0.devices=[cuda:0,cuda:1]' --set 'stages.1.devices=[cuda:0,cuda:1]' \
    --baselines hf,hf-assisted,ar --json "$OUT/llama-3-70b-tree-draft-tp2.json"
fi
