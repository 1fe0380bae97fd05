#!/usr/bin/env bash
# The pipeline executor (PipeSpec) on a 2-GPU machine (see scripts/gpu_setup.sh): `draft` widened
# to Llama-3.2-1B, `mid` to 3B, the target to the Llama-3-8B shape. The target on cuda:0, mid and
# draft on cuda:1 (separate processes). In one JSON each ($OUT):
#   pipeline-3   the 3-stage asynchronous pipeline, beside `ar` (target alone, cuda:0) and `serial`
#                (draft verified by the target on the serial executor, cuda:0)
#   pipeline-3-sync  the same topology, synchronous (each stage waits for the one above)
#   pipeline-2   draft -> target asynchronous (draft on cuda:1)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-64}
NEW_TOKENS=${NEW_TOKENS:-128}
RUNS=${RUNS:-"3 3-sync 2"}
mkdir -p "$OUT"
source scripts/gpu_setup.sh

head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
common=(--prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats 1 --widen llama-3-8b
        --set models.mid.path=../.fixtures/mid)
three=(--set 'stages.0.devices=[cuda:1]' --set 'stages.1.devices=[cuda:1]' --set 'stages.2.devices=[cuda:0]')
for run in $RUNS; do
  case $run in
    3) sg bench recipes/pipeline.yaml "${common[@]}" "${three[@]}" --baselines ar,serial --json "$OUT/llama-3-8b-pipeline-3.json" ;;
    3-sync) sg bench recipes/pipeline.yaml "${common[@]}" "${three[@]}" --set pipeline.synchronous=true --baselines "" \
              --json "$OUT/llama-3-8b-pipeline-3-sync.json" ;;
    2) sg bench recipes/pipeline.yaml "${common[@]}" --set 'stages=[{name: draft, model: draft, devices: [cuda:1], tree: {shape: chain, length: 4}}, {name: target, model: target, devices: [cuda:0], verifies: draft, verify: {window: 4}}]' \
         --baselines "" --json "$OUT/llama-3-8b-pipeline-2.json" ;;
  esac
done
