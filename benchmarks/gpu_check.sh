#!/usr/bin/env bash
# The GPU checks in one command, for an H200 machine without network access (installs nothing
# from the network). Every step writes into the output folder ($OUT when set, else
# benchmarks/results/) while it runs: its log line by line, benchmark JSON after every
# configuration. Each step has its own time limit; a failed or timed-out step never stops the
# next. The last step writes gpu_summary.md (what ran, what passed, the key ratios).
#
#   bash benchmarks/gpu_check.sh             # default: at most 7 minutes (the step limits below)
#   bash benchmarks/gpu_check.sh --long      # the long benchmark sweeps, at most 10 minutes
#   bash benchmarks/gpu_check.sh --dry-run   # CPU: every step at tiny sizes, into a temporary folder
#
# Steps and limits in seconds (default / --long): wheels 10, env 20, cuda_kernels 70 (the tests
# marked cuda, anywhere under tests/, whose names hold neither "graph" nor "reduce_overhead":
# kernels, FlashMLA, mla_prefill), dsa 60 (the cuda tests of DeepSeek Sparse Attention, in $dsa_files:
# the indexer's fused score + top-k kernel (at K = 2048 too), sparse attention, a DSA model's CUDA-graph generation, and vLLM's packed cache formats read in place
# by the Triton kernels: fp8_ds_mla latent rows, fp8_per_token index keys, their writes byte-equal to the CPU's),
# kernel_bench 50 / 180, absorbed_bench 45 / 175,
# device_path_bench 40 (the device path at K = 1, 4, 16 against the host path), cuda_graphs 65
# (those that do: CUDA graphs, torch.compile, PrefillGraphs), graphs_bench 45 / 120 (PrefillGraphs
# replay vs eager), cuda_models 0 / 120 (--long only: the cuda tests of MoE, generation and context
# parallel, named in $model_tests and left out of the two others), vllm_<release> 0 / 240 for each CUDA
# release the vLLM plugin serves (--long only; "not_run" at once without its wheels: below), summary 15; 420 s
# in all (875 with --long and no vllm wheels: two device calls, or a 10-minute one without the model tests), and `timeout -k 5` kills a step at most 5 s past its limit. A dry run allows 10x each
# limit: it checks the code paths, not the speed.
#
# Wheels in .whl/ are installed first (--no-deps, into /tmp/site): FlashMLA is measured only if
# its wheel came along. Fetch it here once; .whl/ is git-ignored, so carry it to the device:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl sgl-flash-mla==1.0.0
set -uo pipefail
cd "$(dirname "$0")/.."

long=0 dry=0
for arg in "$@"; do
    case "$arg" in
        --long) long=1 ;;
        --dry-run) dry=1 ;;
        *) echo "usage: bash benchmarks/gpu_check.sh [--long] [--dry-run]" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"   # never reuse code compiled from older lowerings
dry_flag=()
[ "$dry" = 1 ] && dry_flag=(--dry-run)
flags=("${dry_flag[@]}")
[ "$long" = 1 ] && flags+=(--long)
if [ "$dry" = 1 ]; then
    out="${OUT:-$(mktemp -d -t mla_ops_gpu_check_dry_XXXX)}"
    case "$(realpath -m "$out")/" in
        "$(realpath -m benchmarks/results)"/*) echo "--dry-run writes nothing under benchmarks/results/" >&2; exit 2 ;;
    esac
else
    out="${OUT:-benchmarks/results}"
fi
mkdir -p "$out"
steps="$out/gpu_steps.tsv"
printf 'step\tstatus\trc\tseconds\tlimit_s\n' > "$steps"
failed=0

# step NAME LIMIT_S COMMAND...: run under a time limit, log to $out/NAME.log as it goes, record the outcome.
# (A file, not a pipe through tee: a pipe would wait on any child still holding it after a kill.)
step() {
    local name=$1 limit=$2 start=$SECONDS rc status
    shift 2
    [ "$dry" = 1 ] && limit=$((limit * 10))
    echo "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 25 "$out/$name.log"
    case $rc in
        0) status=passed ;;
        77) status=not_run ;;  # a step that cannot run on this device says why in its log
        124|137) status=timed_out ;;
        *) status=failed ;;
    esac
    [ $rc -eq 0 ] || [ $rc -eq 77 ] || failed=1
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$limit" >> "$steps"
    echo "== $name: $status after $((SECONDS - start))s"
}

# Wheels go to /tmp/site (a dry run's into its own folder), found through PYTHONPATH.
site=/tmp/site
[ "$dry" = 1 ] && site="$out/site"
step wheels 10 bash -c 'if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no wheels in .whl/: FlashMLA is not measured"
    else "$0" -m pip install -q --no-index --no-deps --no-compile --target "$1" .whl/*.whl && ls "$1"; fi' "$PY" "$site"
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
step env 20 "$PY" -m benchmarks.gpu_summary env --json "$out/gpu_env.json" "${dry_flag[@]}"
# The GPU tests: marked cuda wherever they live under tests/ (tests/interpreter is its own run),
# split by name. The model tests are long: --long only.
pytest_flags=(-m cuda -p no:cacheprovider -v -rs)
pytest_args=("${pytest_flags[@]}" tests --ignore=tests/interpreter)
model_tests="test_grouped_moe_on_cuda_compiles_and_captures or test_generation_on_cuda_equals_cpu_eager_and_compiled"
model_tests+=" or test_cuda_latent_attention_kernel or test_cuda_one_rank_equals_single_device"
dsa_files=(tests/ops/test_indexer.py tests/ops/test_sparse.py tests/serving/test_dsa_serving.py
    tests/prefill/test_cache_formats_prefill.py)
step cuda_kernels 70 "$PY" -m pytest "${pytest_args[@]}" "${dsa_files[@]/#/--ignore=}" \
    -k "not graph and not reduce_overhead and not ($model_tests)"
step dsa 60 "$PY" -m pytest "${pytest_flags[@]}" "${dsa_files[@]}"
if [ "$long" = 1 ]; then bench_limit=180; graphs_limit=120; else bench_limit=50; graphs_limit=45; fi
step kernel_bench "$bench_limit" "$PY" -m benchmarks.kernel_bench --json "$out/gpu_kernels.json" "${flags[@]}"
step absorbed_bench $((bench_limit - 5)) "$PY" -m benchmarks.absorbed_bench --json "$out/gpu_absorbed.json" \
    "${flags[@]}"
step device_path_bench 40 "$PY" -m benchmarks.device_path_bench --json "$out/gpu_device_path.json" "${flags[@]}"
step cuda_graphs 65 "$PY" -m pytest "${pytest_args[@]}" "${dsa_files[@]/#/--ignore=}" \
    -k "(graph or reduce_overhead) and not ($model_tests)"
step graphs_bench "$graphs_limit" "$PY" -m benchmarks.graphs_bench --json "$out/gpu_graphs.json" "${flags[@]}"
if [ "$long" = 1 ]; then
    step cuda_models 120 "$PY" -m pytest "${pytest_args[@]}" -k "$model_tests"
fi
# vllm_<release> (--long only): mla-ops as vLLM's MLA backend on CUDA (tests/integrations/vllm, marked cuda:
# TRITON_MLA, and FLASHMLA on SM90) under vLLM's compilation and CUDA graphs, once for each CUDA release the
# plugin serves (mla_ops/integrations/vllm/settings.py: RELEASES["cuda"]). Each needs its vllm wheel and what
# it pins (torch with CUDA: 2.13.0 for 0.32.0, 2.14.0 for 0.33.0 and 0.34.0; transformers; flashinfer-python;
# ...) in .whl/vllm-<release>/, installed --no-index into its own folder. The vllm wheels alone are 228-321 MiB,
# past a device call's 64 MiB carry, and the lent machines reach no network: there every release's step says so
# and ends "not_run" (exit 77), which fails nothing. Where the device can read a folder: fetch them with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl/vllm-<release> vllm==<release>
if [ "$long" = 1 ]; then
    for release in $("$PY" -c 'from mla_ops.integrations.vllm import settings; print(*settings.RELEASES["cuda"])'); do
        step "vllm_$release" 240 bash -c 'wheels=.whl/vllm-$2
            if ! ls "$wheels"/vllm-"$2"-*.whl >/dev/null 2>&1; then
                echo "vllm $2: not run: no $wheels/vllm-$2-*.whl. Its wheel and pinned dependencies (CUDA torch among"
                echo "them) exceed a device call'"'"'s 64 MiB carry; fetch them into $wheels where the device can read them."
                exit 77; fi
            "$0" -m pip install -q --no-index --no-compile --target "$1/vllm-$2" "$wheels"/*.whl &&
            "$0" -m pip install -q --no-index --no-deps --no-build-isolation --target "$1/vllm-$2" . &&  # the entry point
            PYTHONPATH="$1/vllm-$2:$PYTHONPATH" "$0" -m pytest -m cuda -p no:cacheprovider -v -rs tests/integrations/vllm' \
            "$PY" "$site" "$release"
    done
fi
step summary 15 "$PY" -m benchmarks.gpu_summary summary --dir "$out" "${dry_flag[@]}"
echo "results in $out"
exit $failed
