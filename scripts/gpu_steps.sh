#!/usr/bin/env bash
# One device call's work as named steps under one time limit (a fresh GPU machine with only this repository,
# set up as scripts/gpu_setup.sh says):
#
#   bash scripts/gpu_steps.sh SECONDS STEP [STEP ...]
#
# Runs the steps in order while time is left (a step is skipped once less than half its own limit remains), each
# under its own limit (or the time left, if less), its output in $OUT/steps.log (and on standard output); each
# step's exit status in $OUT/steps.tsv; what the steps write under $OUT/files/ (reports, traces, summaries) packed into
# $OUT/files.tar when the steps end, so that a call brings back few files. Each line of a step's output is
# stamped with the time it was printed. Steps: see `case` below
# (GPU_TESTS: a pytest -k expression for the step gputests; BENCH_SET: a --set for the bench steps; LIMIT: each
# step's limit in seconds in place of its own).
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$(( $(date +%s) + $1 - 15 ))
shift
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/files"
source scripts/gpu_setup.sh
export OUT
prompts=.fixtures/prompts_code.jsonl
batches=${BATCHES:-1,2,4,8,16,32,64}
# (quant-hang: a failed lowering's own error and the frames around it printed, its arguments named briefly)
short_lowering_errors='import torch._inductor.exc as exc
def brief(arg):
    try:
        return "%s%s" % (type(arg).__name__, list(arg.get_size()))
    except Exception:
        return type(arg).__name__
def operator_str(target, args, kwargs):  # (with the frames that raised it, and where it will be caught: the stack)
    import sys, traceback
    frames = [f for f in traceback.extract_stack()[:-2] if "torch" in f.filename or "specgraph" in f.filename]
    error = sys.exc_info()[1]  # (the lowering error: LoweringException is made in its except block)
    print("lowering failed: %s %s: %s: %.300s" % (target, [brief(arg) for arg in args], type(error).__name__, error),
          file=sys.stderr)
    print("".join(traceback.format_tb(error.__traceback__)[-6:]) if error else "", file=sys.stderr)
    print("".join(traceback.format_list(frames[-30:])), file=sys.stderr)
    return "  target: %s, args: %s" % (target, [brief(arg) for arg in args])
import specgraph.lower  # (whose compile_model installs its own brief message: this one in its place)
specgraph.lower.brief_lowering_errors = lambda: setattr(exc.OperatorIssue, "operator_str", staticmethod(operator_str))'
sweep=(--prompts "$prompts" --max-new-tokens 128 --widen llama-3-8b --batch "$batches" ${BENCH_SET:+--set "$BENCH_SET"})

run_step() {  # NAME LIMIT COMMAND... (LIMIT in the environment: every step's limit, for a call that runs two sets)
  # a step runs under its limit or the time left, whichever is less, unless less than half its limit is left (the
  # set-up, ~30 s on a fresh machine, counts against the call: runs 143's first two calls skipped every step when a
  # step's limit was the call's seconds less 15)
  local name=$1 limit=${LIMIT:-$2} left=$(( deadline - $(date +%s) ))
  shift 2
  if [ $(( 2 * left )) -lt "$limit" ]; then
    printf '%s\tskipped (%s s left, needs %s)\n' "$name" "$left" "$limit" | tee -a "$OUT/steps.tsv"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name ($(date +%T), limit $limit s)"
  local began=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done
  local rc=${PIPESTATUS[0]}
  printf '%s\trc %s\t%s s\n' "$name" "$rc" "$(( $(date +%s) - began ))" | tee -a "$OUT/steps.tsv"
}

step() {
  case $1 in
    probe)  # a program built after another decodes its own ar's tokens (runs 99-100's fault)
      run_step probe-after-chain 150 python3 scripts/probe_batch.py two-programs
      run_step probe-fresh 120 python3 scripts/probe_batch.py two-programs fresh ;;
    fp32)  # the fp32 GPU tests whose oracles are ar and transformers
      run_step fp32-tests 240 python3 -m pytest -q -o addopts= -p no:cacheprovider -rA tests/test_gpu.py \
        -k "fp32_speculation or fp32_on_gpu" ;;
    gputests)  # each test's result as it ends (-v: a call cut at its limit still says which passed)
      run_step gpu-tests 540 python3 -m pytest -v -o addopts= -p no:cacheprovider -rfE --durations=15 tests/test_gpu.py \
        ${GPU_TESTS:+-k "$GPU_TESTS"} ;;
    hybrid)  # the hybrid fixture's GPU tests (carry [".cache/hybrid"]: the fixture, prompts and wheels, gpu_setup.sh)
      run_step hybrid-tests 330 python3 -m pytest -v -o addopts= -p no:cacheprovider -rfE --durations=10 tests/test_gpu.py \
        -k "hybrid or gated_delta" ;;
    hybrid-batch)  # issue 58 step 5: the hybrid recipe (its dynamic tree under the policy) against ar and every step
      # speculating (the fixed tree), at the Qwen3.5 shape SHAPE (default qwen3.5-9b; carry [".cache/hybrid"])
      run_step "hybrid-batch-${SHAPE:-qwen3.5-9b}" 540 python3 -m specgraph bench recipes/hybrid.yaml \
        --set models.target.path=../.fixtures/hybrid --prompts "$prompts" --max-new-tokens 128 \
        --widen "${SHAPE:-qwen3.5-9b}" --batch "${BATCHES:-4,8}" --baselines ar,always \
        --json "$OUT/files/${SHAPE:-qwen3.5-9b}-hybrid-batch.json" ;;
    quant-hang)  # the quantized row-invariant test that ran past every limit (runs 114, 117: Inductor formatted a failed
      # lowering's nested IR for minutes; lower.brief_lowering_errors now names its arguments briefly): which lowering
      # fails, its error and the frames around it, every stack at 200 s
      run_step quant-hang 240 python3 -c "$short_lowering_errors"'
import sys, pytest
sys.exit(pytest.main(["-v", "-o", "addopts=", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=200",
                      "tests/test_gpu.py", "-k", "row_invariant_speculation_over_a_quantized"]))' ;;
    profile8b)  # traces of steady steps at the Llama-3-8B shape (run 102: the build alone took over 240 s)
      run_step profile-8b 450 python3 scripts/profile_engine.py recipes/dynamic.yaml --systems ar,specgraph \
        --batches 1,8 --widen llama-3-8b --out "$OUT/files" ;;
    engine)  # every step speculating (its `= ar` column) against ar, then the policy alone: reports apart, so
      # that a policy whose build (its timing of steps) outlasts the limit leaves the first's figures
      run_step engine-always 330 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" \
        --set serving.speculation=always --baselines ar --json "$OUT/files/llama-3-8b-always.json"
      run_step engine-policy 225 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" --baselines "" \
        --json "$OUT/files/llama-3-8b-policy.json" ;;
    policy)  # the policy alone (its timing of steps, then the batch sizes), for a call too short for `engine`
      run_step policy 330 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" --baselines "" \
        --json "$OUT/files/llama-3-8b-policy.json" ;;
    profile-policy)  # traces of the policy's steady steps (its build times its modes first), batch 8 then 1
      run_step profile-policy 420 python3 scripts/profile_engine.py recipes/dynamic.yaml --systems specgraph \
        --batches "${BATCHES:-8,1}" --widen llama-3-8b --out "$OUT/files" ;;
    qlinear)  # the quantized projections (int4, fp8) against bf16 and tinygemm at the 8B shapes, 1-64 rows
      run_step qlinear 150 python3 scripts/bench_qlinear.py ;;
    quant)  # the policy recipe and ar with quantized weights (SCHEME: w4a16, w8a16 or fp8), batch 1 and 8 by default
      run_step "quant-${SCHEME:-w4a16}" 420 python3 -m specgraph bench recipes/dynamic.yaml --prompts "$prompts" \
        --max-new-tokens 128 --widen "llama-3-8b:${SCHEME:-w4a16}" --batch "${BATCHES:-1,8}" --baselines ar \
        --json "$OUT/files/llama-3-8b-${SCHEME:-w4a16}-policy-ar.json" ;;
    profile-kernels)  # each kernel's own time (dependent launches off) in steady steps of ar at batch 1 and 8 and of
      # the recipe's tree at 8, by class, and ar's share of its floor (issue 57's first table)
      run_step profile-kernels 420 env SPECGRAPH_PDL=0 python3 scripts/profile_engine.py recipes/dynamic.yaml \
        --systems ar,specgraph --batches "${BATCHES:-1,8}" --set serving.speculation=always --widen llama-3-8b \
        --out "$OUT/files" ;;
    attention-kernel)  # the step attention at prompt-chunk and decode shapes, row blocks of 32, 64, 128, against SDPA
      run_step attention-kernel 150 python3 scripts/bench_attention.py --json "$OUT/files/attention.json" ;;
    profile-prompt)  # traces of the drafter's prompt forward at a 512- and a 2,048-token chunk (scripts/profile_prompt.py)
      run_step profile-prompt 240 python3 scripts/profile_prompt.py recipes/dynamic.yaml --chunks 512,2048 \
        --widen llama-3-8b --out "$OUT/files" ;;
    few-rows)  # the tiles against cuBLAS from 2 to 64 rows: where FEW_ROWS should be
      run_step few-rows 150 python3 scripts/bench_few_rows.py --json "$OUT/files/few-rows.json" ;;
    sweep-dynamic)  # the policy (adaptive) against every step speculating, ar and transformers, every batch size
      run_step sweep-dynamic 540 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" \
        --baselines ar,always,hf --json "$OUT/files/llama-3-8b-dynamic-sweep.json" ;;
    sweep-tree)
      run_step sweep-tree 420 python3 -m specgraph bench recipes/tree.yaml "${sweep[@]}" --baselines always \
        --json "$OUT/files/llama-3-8b-tree-sweep.json" ;;
    sweep-budget)  # Bole's budget under the policy, epsilon swept at batch 8
      run_step sweep-budget 420 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" \
        --set 'stages.1.verify.budget={epsilon: 0.1}' --baselines always --json "$OUT/files/llama-3-8b-budget-sweep.json"
      run_step epsilon-8b 300 python3 -m specgraph bench recipes/dynamic.yaml --prompts "$prompts" --max-new-tokens 128 \
        --widen llama-3-8b --batch 8 --set 'stages.1.verify.budget={epsilon: 0.1}' \
        --baselines ar,epsilon=0,epsilon=0.25,epsilon=0.5 --json "$OUT/files/llama-3-8b-epsilon.json" ;;
    policy-ar)  # the policy against ar in one report (its timing of steps first: about 200 s at the 8B shape)
      run_step policy-ar 540 python3 -m specgraph bench recipes/dynamic.yaml "${sweep[@]}" --baselines ar \
        --json "$OUT/files/llama-3-8b-policy-ar.json" ;;
    eagle-policy)  # the EAGLE-3 head recipe under the policy alone (ar: policy-ar's, on the same machine)
      run_step eagle-policy 420 python3 -m specgraph bench recipes/eagle3.yaml "${sweep[@]}" --baselines "" \
        --json "$OUT/files/llama-3-8b-eagle3-policy.json" ;;
    aoti)  # where AOTInductor's CUDA package crashes (scripts/aoti_repro.py: about 80 s a package to compile)
      run_step aoti 290 python3 scripts/aoti_repro.py --cases matmul,linear --no-program --seconds 280 ;;
    seeded)  # what the sampling rule's keyed noise costs a verification against the greedy rule (issue 54)
      run_step seeded 240 python3 scripts/bench_seeded.py
      run_step seeded-top-p 240 python3 scripts/bench_seeded.py --top-p 0.95 ;;
    train-head)  # issue 55: the head's main run (its heads at 500, 1000 and 3000 steps), then the ablations at 500 steps
      # (training-time-test depth 1, 3, 7 beside the main run's 5; corpus text beside the target's), from .cache/e55/
      # (gen.jsonl and corpus.jsonl: docs/eagle.md says how they were made); the heads come back without their state,
      # but a call brings back at most 8 files and a files.tar of 7 heads (35 MB) was too large (run 115): copy a few
      # heads at a time into $OUT in the calls after, while the machine is warm (runs 116-117 did so)
      local data=.cache/e55 heads=$OUT/files/heads
      for archive in $data/*.xz; do [ -f "${archive%.xz}" ] || xz -dk "$archive"; done  # (carried compressed)
      local train=(python3 -m specgraph train-draft recipes/models/target --batch 32 --seq-len 256 --draft-vocab 2048
        --intermediate-size 512 --device "${TRAIN_DEVICE:-cuda}" --lr 1e-3 --dtype bfloat16 --decay-steps 3000 --threads 4)
      rm -rf /tmp/main  # (a warm machine's earlier run would be resumed past 500: each step's head must be its own)
      for steps in 500 1000 3000; do
        run_step "main-$steps" 200 "${train[@]}" --data $data/gen.jsonl --ttt 5 --steps $steps -o /tmp/main
        mkdir -p "$heads/main-$steps" && cp /tmp/main/*.json /tmp/main/*.safetensors "$heads/main-$steps/"
      done
      for ttt in 1 3 7; do
        run_step "ttt-$ttt" 120 "${train[@]}" --data $data/gen.jsonl --ttt $ttt --steps 500 -o "$heads/ttt-$ttt"
      done
      run_step corpus 120 "${train[@]}" --data $data/corpus.jsonl --ttt 5 --steps 500 -o "$heads/corpus-5"
      rm -rf "$heads"/*/training ;;
    sweep-eagle)
      run_step sweep-eagle 560 python3 -m specgraph bench recipes/eagle3.yaml "${sweep[@]}" --baselines ar \
        --json "$OUT/files/llama-3-8b-eagle3-sweep.json" ;;
    *) echo "unknown step $1"; return 1 ;;
  esac
}

{
  for name in "$@"; do step "$name"; done
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
} 2>&1 | tee -a "$OUT/steps.log"
tar cf "$OUT/files.tar" -C "$OUT" files && rm -r "$OUT/files"
cat "$OUT/steps.tsv"
