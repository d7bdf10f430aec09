#!/usr/bin/env bash
# The GPU tests, on a CUDA machine: `bash test/run_gpu.sh [extra pytest arguments]`.
#
# Runs every test marked `gpu` under test/registered, with this checkout's package and SGLang 0.5.23
# as test/gpu_env.sh finds it: the installed SGLang where `import sglang` works, else the files of
# the wheel in .whl/. Without SGLang's dependencies, the modules that need them are reported as
# skipped. Fails when a test fails, and when no GPU test ran at all (all skipped or deselected).
# The pytest log goes to $OUT/gpu-tests.log when the variable OUT names a folder, else to a
# temporary folder; the last line says where.
set -euo pipefail
cd "$(dirname "$0")/.."
source test/gpu_env.sh

log=${OUT:-$(mktemp -d)}/gpu-tests.log
python3 -c 'import torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"GPU tests on {gpu}: torch {torch.__version__}, triton {triton.__version__}")' | tee "$log"
status=0
python3 -m pytest -m gpu test/registered -rs "$@" 2>&1 | tee -a "$log" || status=$?

summary=$(grep -E '([0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' || true)
echo
echo "GPU tests: ${summary:-no pytest summary} (log: $log)"
if [ "$status" -ne 0 ]; then
    echo "GPU tests FAILED (pytest exit status $status)" >&2
    exit "$status"
fi
if ! grep -qE '[0-9]+ passed' <<<"$summary"; then
    echo "GPU tests FAILED: no GPU test ran" >&2
    exit 1
fi
