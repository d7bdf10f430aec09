#!/usr/bin/env bash
# All the GPU tests, on a CUDA machine, in one command:
#
#   bash test/run_gpu.sh [--triton DIR|FILE.tar.xz] [--kernels|--sglang] [pytest arguments...]
#
# Two pytest sessions, each over the tests marked `gpu`:
#   kernels  the test modules that do not need SGLang's runtime, with test/gpu_env.sh (this package,
#            SGLang's files for its reference kernels);
#   sglang   the test modules that call require_sglang(), with test/gpu_sglang_env.sh (SGLang's
#            runtime: the installed SGLang, or the one test/pack_gpu_payload.sh packs into .whl/).
# Where SGLang's runtime cannot be set up, the kernels session runs every module, the others are
# reported as skipped with the reason, and the last lines say what to fetch.
#
# --triton DIR runs against the Triton in DIR (a folder holding triton/, such as a Triton wheel
# unzipped), or in a .tar.xz of such a folder (unpacked once into $TMPDIR), for example the
# .whl/triton-3.8.0-cp312-slim.tar.xz of `bash test/pack_gpu_payload.sh --triton 3.8.0`;
# GPU_TRITON=DIR does the same. TRITON_PTXAS_PATH defaults to the CUDA toolkit's ptxas
# (/usr/local/cuda/bin/ptxas) then, as the slim Triton has none of its own.
# --kernels / --sglang run one session only. Other arguments go to pytest in every session (-k EXPR,
# -x, ...); test paths among them choose the modules, each to its session.
#
# Prints the GPU, Python, torch, Triton, transformers and SGLang each session used; the log of both goes to
# $OUT/gpu-tests-triton-<version>.log when OUT names a folder, else to a temporary folder. Fails when
# a session fails, and when no GPU test passed at all.
set -euo pipefail
cd "$(dirname "$0")/.."

triton=${GPU_TRITON:-}
sessions=(kernels sglang)
pytest_args=() paths=()
while [ $# -gt 0 ]; do
    case $1 in
        --triton) triton=${2:?--triton needs a folder or a .tar.xz}; shift ;;
        --triton=*) triton=${1#--triton=} ;;
        --kernels) sessions=(kernels) ;;
        --sglang) sessions=(sglang) ;;
        -k | -m | -p | -o | -c | --deselect | --ignore | --ignore-glob | --rootdir | --basetemp | --confcutdir)
            pytest_args+=("$1" "${2:?$1 needs a value}"); shift ;;
        -*) pytest_args+=("$1") ;;
        *) if [ -e "${1%%::*}" ]; then paths+=("${1#./}"); else pytest_args+=("$1"); fi ;;
    esac
    shift
done

if [ -n "$triton" ]; then
    if [ -f "$triton" ]; then  # a tarball: unpacked once, keyed by its content
        dir=${TMPDIR:-/tmp}/triton-$(sha256sum "$triton" | cut -c1-16)
        if [ ! -d "$dir" ]; then
            partial=$(mktemp -d "$dir.XXXXXX")
            tar -xJf "$triton" -C "$partial" && mv -T "$partial" "$dir"
        fi
        triton=$dir
    fi
    if [ ! -d "$triton/triton" ]; then
        echo "run_gpu.sh: $triton holds no triton/ package" >&2
        exit 2
    fi
    export PYTHONPATH="$(cd "$triton" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
    if [ -z "${TRITON_PTXAS_PATH:-}" ] && [ -x /usr/local/cuda/bin/ptxas ]; then
        export TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas
    fi
fi
triton_version=$(python3 -c 'import triton; print(triton.__version__)')
log=${OUT:-$(mktemp -d)}/gpu-tests-triton-$triton_version.log
: >"$log"

# The modules that need SGLang's runtime, at or under the paths given (default: test/registered).
sglang_list=$(PYTHONPATH=python:test python3 -m support.sglang_import "${paths[@]%%::*}")
sglang_modules=()
[ -n "$sglang_list" ] && mapfile -t sglang_modules <<<"$sglang_list"
declare -A needs_sglang=()
for module in "${sglang_modules[@]}"; do needs_sglang[$module]=1; done
runtime_error=$( (source test/gpu_sglang_env.sh) 2>&1 >/dev/null) && runtime_error= ||
    runtime_error=$(tail -n 1 <<<"$runtime_error")

versions() {
    python3 - "$1" <<'PY'
import os, sys
import torch, transformers, triton
from importlib import metadata
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
try:
    sglang = f"SGLang {metadata.version('sglang')} ({os.environ.get('GPU_SGLANG', '?')})"
except metadata.PackageNotFoundError:
    sglang = f"SGLang's files only ({os.environ.get('GPU_SGLANG', '?')})"
print(f"GPU tests, {sys.argv[1]} session, on {gpu}: python {sys.version.split()[0]}, "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), "
      f"transformers {transformers.__version__}, {sglang}")
PY
}

status=0 summaries=()
session() {  # session NAME ENV_SCRIPT PYTEST_ARGUMENTS...
    local name=$1 env=$2 rc=0 out summary
    shift 2
    out=$(mktemp)
    echo "=== $name session ===" | tee -a "$log"
    (source "$env" && versions "$name" && python3 -m pytest -m gpu -rs "${pytest_args[@]}" "$@") 2>&1 |
        tee "$out" | tee -a "$log" || rc=$?
    summary=$(grep -E '([0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran).* in [0-9.]+s' "$out" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' || true)
    rm -f "$out"
    summaries+=("$name: ${summary:-no pytest summary}")
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then  # 5: no test selected in this session
        status=$rc
    fi
}

for name in "${sessions[@]}"; do
    if [ "$name" = kernels ]; then
        selected=() ignores=()
        for path in "${paths[@]:-test/registered}"; do
            if [ -n "$runtime_error" ] || [ -z "${needs_sglang[${path%%::*}]:-}" ]; then
                selected+=("$path")
            fi
        done
        if [ -z "$runtime_error" ]; then
            for module in "${sglang_modules[@]}"; do ignores+=(--ignore "$module"); done
        fi
        if [ ${#selected[@]} -gt 0 ]; then
            session kernels test/gpu_env.sh "${ignores[@]}" "${selected[@]}"
        fi
    elif [ -n "$runtime_error" ]; then
        summaries+=("sglang: NOT RUN, SGLang's runtime is not set up here")
    else
        selected=()
        if [ ${#paths[@]} -eq 0 ]; then
            selected=("${sglang_modules[@]}")
        fi
        for path in "${paths[@]}"; do
            if [ -f "${path%%::*}" ]; then
                if [ -n "${needs_sglang[${path%%::*}]:-}" ]; then selected+=("$path"); fi
            else
                for module in "${sglang_modules[@]}"; do
                    if [[ $module == "${path%/}/"* ]]; then selected+=("$module"); fi
                done
            fi
        done
        if [ ${#selected[@]} -gt 0 ]; then
            session sglang test/gpu_sglang_env.sh "${selected[@]}"
        fi
    fi
done

{
    echo
    for line in "${summaries[@]}"; do echo "GPU tests, $line"; done
    if [ -n "$runtime_error" ] && [[ " ${sessions[*]} " == *" sglang "* ]]; then
        echo "GPU tests: the ${#sglang_modules[@]} modules that need SGLang's runtime did not run (${runtime_error})."
        echo "  To run them: build the payload on a machine with a network and this checkout installed"
        echo "  (bash test/pack_gpu_payload.sh fetches SGLang's wheel and those of test/gpu_sglang_deps.txt"
        echo "  into .whl/ and packs .whl/sglang-0.5.23-gpu.tar.xz), bring that file along in .whl/, run again."
    fi
    echo "GPU tests: triton $triton_version, log: $log"
} | tee -a "$log"
if [ "$status" -ne 0 ]; then
    echo "GPU tests FAILED (pytest exit status $status)" >&2
    exit "$status"
fi
if [[ "${summaries[*]}" != *" passed"* ]]; then
    echo "GPU tests FAILED: no GPU test ran" >&2
    exit 1
fi
