#!/usr/bin/env bash
# Run specgraph bench on a fresh GPU machine that has only this repository, plus
#   .fixtures/  mid/, hybrid/ and prompts_code.jsonl from ../shared/fixtures (target and draft are embedded)
#   .whl/       wheels of what the machine may lack (pydantic, rich and their needs; see docs/benchmarks.md)
# Results (JSON per benchmark, and a log) go to $OUT (default: bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
PROMPTS=${PROMPTS:-8}
NEW_TOKENS=${NEW_TOKENS:-128}
REPEATS=${REPEATS:-1}
SHAPE=${SHAPE:-llama-3-8b}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-150}

# Install from local wheels only what does not import (the machine has no package index).
missing=()
for module in pydantic rich pytest; do
  python3 -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing from .whl/ (missing: ${missing[*]})"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

head -n "$PROMPTS" .fixtures/prompts_code.jsonl > "$OUT/prompts.jsonl"
sg() { python3 -m specgraph.cli "$@"; }
common=(--prompts "$OUT/prompts.jsonl" --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --widen "$SHAPE")
mid=(--set models.draft.path=../.fixtures/mid)

python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py || echo "GPU TESTS FAILED"
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
