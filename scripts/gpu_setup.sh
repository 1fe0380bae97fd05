# Sourced by the GPU scripts on a fresh machine that has only this repository, plus
#   .fixtures/  what they need of ../shared/fixtures (mid/, hybrid/, prompts_code.jsonl; target and draft are embedded)
#   .whl/       wheels of what the machine may lack (pydantic and its needs: ../shared/wheels-gpu; compressed-tensors,
#               loguru and psutil for quantized checkpoints and --widen SHAPE:SCHEME; for
#               `serve` and `loadgen`: starlette, uvicorn, httpx and theirs, for its Python; gemlite, the Triton
#               low-bit GEMM scripts/bench_qlinear.py times beside ours)
#   or both in build/carry.tar.xz (`tar cf - .fixtures .whl | xz -9 > build/carry.tar.xz`: about a
#   quarter smaller, for when the repository plus both pass the device's 64 MiB), extracted here; the hybrid
#   fixture does not fit beside mid/ in one call's carry: .cache/hybrid/carry.tar.xz holds it with the prompts and
#   pydantic's wheels (`.whl/` holding only pydantic*, annotated_types*, typing_*: `tar cf - .fixtures/hybrid
#   .fixtures/prompts_code.jsonl .whl | xz -9e > .cache/hybrid/carry.tar.xz`: 22 MB, the repository 43),
#   carry [".cache/hybrid"] for the hybrid GPU tests and gpu_steps.sh's hybrid-batch), extracted here too
# Installs from .whl/ whatever does not import, keeps NVLink multicast off, and prints the versions.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-150}
export SPECGRAPH_PROGRESS=1  # the build's steps in the logs (cli.py's build_progress)
for archive in build/carry.tar.xz .cache/hybrid/carry.tar.xz; do  # (whichever this call carried)
  if [ -f "$archive" ]; then
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(filter='data')" "$archive"
  fi
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site  # (before the check: a warm machine has /tmp/site already)
missing=()
for module in pydantic rich pytest starlette uvicorn httpx compressed_tensors gemlite; do
  python3 -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing from .whl/ (missing: ${missing[*]})"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
sg() { python3 -m specgraph "$@"; }
