# Source before the GPU tests or a kernel benchmark, on any CUDA machine:
#
#   source test/gpu_env.sh && python3 test/registered/kernels/benchmark/attention/bench_dsa_metadata_bounded.py
#
# Puts this checkout's python/ first on PYTHONPATH and makes SGLang 0.5.23's files findable:
# - where `import sglang` works (SGLang installed with its dependencies), that SGLang is used;
# - where it does not (a machine with torch and triton but without SGLang's dependencies or a
#   network), the SGLang wheel placed in .whl/ (ignored by git) is unpacked into a temporary folder
#   and that folder goes on PYTHONPATH. Nothing is pip-installed: the kernel tests and benchmarks
#   only need SGLang's files, from which test/reference.py loads SGLang's pure-Triton kernels by
#   file path, without importing `sglang`; the tests that need SGLang's runtime skip there.

_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if python3 -c 'import sglang' >/dev/null 2>&1; then
    echo "gpu_env.sh: using the installed SGLang ($(python3 -c 'from importlib.metadata import version; print(version("sglang"))' 2>/dev/null || echo "version unknown"))" >&2
    export PYTHONPATH="$_repo/python${PYTHONPATH:+:$PYTHONPATH}"
else
    _wheel=$(ls "$_repo"/.whl/sglang-0.5.23-*.whl 2>/dev/null | head -n 1)
    _tree=${TMPDIR:-/tmp}/sglang-0.5.23-files
    if [ -z "$_wheel" ]; then
        echo "gpu_env.sh: SGLang does not import here and .whl/ holds no sglang-0.5.23 wheel:" \
            "install SGLang 0.5.23, or put its wheel in .whl/ (pip download --no-deps sglang==0.5.23)" >&2
        unset _repo _wheel _tree
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
    echo "gpu_env.sh: SGLang does not import here; using the files of $_wheel" >&2
    export PYTHONPATH="$_repo/python:$_tree${PYTHONPATH:+:$PYTHONPATH}"
    unset _wheel _tree _partial
fi
unset _repo
