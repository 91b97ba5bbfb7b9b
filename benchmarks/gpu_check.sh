#!/usr/bin/env bash
# The GPU checks in one command, for an H200 machine without network access (installs nothing):
# the `cuda` tests, then the kernel benchmark. Results land in benchmarks/results/ (and in $OUT
# when the device tool runs it). About 5 minutes; every step has its own time limit.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"   # never reuse code compiled from older lowerings
results=benchmarks/results
mkdir -p "$results"
status=0

python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), "flash_mla:", __import__("importlib").util.find_spec("flash_mla") is not None)' \
    || exit 1

timeout 240 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rs 2>&1 \
    | tee "$results/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 300 python3 benchmarks/kernel_bench.py --json "$results/gpu_kernels.json" \
    --plot "$results/gpu_kernels.png" 2>&1 | tee "$results/gpu_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ -n "${OUT:-}" ]; then
    cp "$results"/gpu_tests.log "$results"/gpu_kernels.* "$OUT"/ 2>/dev/null
fi
exit $status
