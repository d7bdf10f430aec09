# Source on the GPU machine to import this package and SGLang 0.5.23's files without installing them:
#
#   source test/gpu_env.sh && python3 test/registered/kernels/benchmark/attention/bench_dsa_metadata_bounded.py
#
# The GPU machine has torch and triton but no SGLang, no SGLang dependencies and no network. SGLang's
# wheel travels in the ignored folder .whl/ (it is cp311, so pip would refuse it on the machine's
# Python 3.12 anyway). Only its files are needed: reference.py finds the `sglang` package directory
# and loads SGLang's pure-Triton kernels by file path, without importing `sglang`.

_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_wheel=$_repo/.whl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
_tree=${TMPDIR:-/tmp}/sglang-0.5.23-files
if [ ! -f "$_wheel" ]; then
    echo "gpu_env.sh: $_wheel is missing; carry the ignored folder .whl to this machine" >&2
    return 1
fi
if [ ! -d "$_tree/sglang" ]; then
    _partial=$(mktemp -d "$_tree.XXXXXX")
    python3 - "$_wheel" "$_partial" <<'PY'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [name for name in wheel.namelist() if name.startswith("sglang/")])
PY
    mkdir -p "$_tree" && mv "$_partial/sglang" "$_tree/" && rmdir "$_partial"
fi
export PYTHONPATH="$_repo/python:$_tree${PYTHONPATH:+:$PYTHONPATH}"
unset _repo _wheel _tree _partial
