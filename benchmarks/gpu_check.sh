#!/usr/bin/env bash
# The GPU checks in one command, for an H200 machine without network access (installs nothing
# from the network): the `cuda` tests, the kernel benchmark, the absorbed-vs-MHA sweep. Results
# land in benchmarks/results/ (and in $OUT when the device tool runs it). Under 8 minutes: every
# step has its own time limit. FlashMLA is used when its wheel was carried in .whl/:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl sgl-flash-mla==1.0.0     # here, once
#   bash benchmarks/gpu_check.sh                                          # there
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"   # never reuse code compiled from older lowerings
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
results=benchmarks/results
mkdir -p "$results"
status=0

python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), "flash_mla:", __import__("importlib").util.find_spec("flash_mla") is not None)' \
    || exit 1

timeout 180 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rs 2>&1 \
    | tee "$results/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 180 python3 benchmarks/kernel_bench.py --json "$results/gpu_kernels.json" \
    --plot "$results/gpu_kernels.png" 2>&1 | tee "$results/gpu_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 90 python3 benchmarks/absorbed_bench.py --json "$results/gpu_absorbed.json" \
    --plot "$results/gpu_absorbed.png" 2>&1 | tee "$results/gpu_absorbed.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ -n "${OUT:-}" ]; then
    cp "$results"/gpu_tests.log "$results"/gpu_kernels.* "$results"/gpu_absorbed.* "$OUT"/ 2>/dev/null
fi
exit $status
