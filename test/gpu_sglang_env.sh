# Source on a GPU machine without SGLang's dependencies to import SGLang 0.5.23 itself: the two-GPU
# route test and benchmark of the argmax exchange build SGLang's real TP group and LogitsProcessor.
#
#   source test/gpu_sglang_env.sh [WHEEL_DIR]
#
# Sources test/gpu_env.sh (this package and SGLang's files on PYTHONPATH), then installs every wheel
# in WHEEL_DIR (default .whl/sglang-deps: the packages of test/gpu_sglang_deps.txt, fetched as that
# file says) into a temporary directory with pip, without an index or dependencies, and puts it on
# PYTHONPATH, with SGLang's dist-info (the plugin registers only for the SGLang version it was tested
# with, read from the installed distribution's metadata). SGLang's native packages (sgl_kernel) stay
# absent: the TP harness (python/sglang_dsa_mtp/testing/tp.py) stubs the ones it never calls
# (python/sglang_dsa_mtp/testing/sglang_stubs.py).
#
# Only the route test and benchmark should run in this environment: with SGLang's metadata present,
# the other test modules would try to import SGLang instead of skipping.

_here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_here/test/gpu_env.sh" || return 1
_wheels=${1:-$_here/.whl/sglang-deps}
_deps=${TMPDIR:-/tmp}/sglang-0.5.23-deps
_meta=${TMPDIR:-/tmp}/sglang-0.5.23-meta
if ! ls "$_wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu_sglang_env.sh: no wheels in $_wheels; fetch them as test/gpu_sglang_deps.txt says" >&2
    return 1
fi
if [ ! -d "$_deps" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$_deps.partial" "$_wheels"/*.whl || return 1
    mv "$_deps.partial" "$_deps"
fi
if [ ! -d "$_meta" ]; then
    python3 - "$_here/.whl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl" "$_meta" <<'PY'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [name for name in wheel.namelist() if name.startswith("sglang-0.5.23.dist-info/")]
    wheel.extractall(sys.argv[2], names)
PY
    [ -d "$_meta" ] || return 1
fi
export PYTHONPATH="$PYTHONPATH:$_deps:$_meta"
unset _here _wheels _deps _meta
