# Source before the kernel tests or a kernel benchmark, on any CUDA machine:
#
#   source test/gpu_env.sh && python3 test/registered/kernels/benchmark/attention/bench_dsa_metadata_bounded.py
#
# Puts this checkout's python/ and test/ (the test support) first on PYTHONPATH and makes SGLang
# 0.5.23's files findable:
# - where `import sglang` works (SGLang installed with its dependencies), that SGLang is used;
# - where it does not (a CUDA machine with torch and triton but without SGLang or a network), from
#   the folder .whl/ at the top of the checkout (ignored by git), unpacked once into $TMPDIR (/tmp):
#   the payload sglang-0.5.23-gpu.tar.xz that test/pack_gpu_payload.sh builds, else SGLang's wheel
#   sglang-0.5.23-*.whl (with the wheels of test/gpu_sglang_deps.txt in .whl/sglang-deps/, if
#   there, for SGLang's runtime). Only SGLang's package folder goes on PYTHONPATH, without its
#   distribution metadata: the kernel tests load SGLang's Triton kernels by file path without
#   importing `sglang`, and the test modules that need SGLang's runtime skip (test/gpu_sglang_env.sh
#   adds the runtime). Layout: test/support/gpu_payload.py.
#
# Exports GPU_SGLANG (installed, payload or wheel) and, from .whl/, GPU_SGLANG_DIR (the unpacked
# folder, with files/ and, where the runtime came too, runtime/). Sourcing it again does nothing.

if [ -z "${GPU_SGLANG:-}" ]; then
    _repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if python3 -c 'import sglang' >/dev/null 2>&1; then
        echo "gpu_env.sh: using the installed SGLang ($(python3 -c 'from importlib.metadata import version; print(version("sglang"))' 2>/dev/null || echo "version unknown"))" >&2
        export GPU_SGLANG=installed PYTHONPATH="$_repo/python:$_repo/test${PYTHONPATH:+:$PYTHONPATH}"
    else
        _payload=$_repo/.whl/sglang-0.5.23-gpu.tar.xz
        _wheel=$(ls "$_repo"/.whl/sglang-0.5.23-*.whl 2>/dev/null | head -n 1)
        _deps=$_repo/.whl/sglang-deps
        if [ -f "$_payload" ]; then
            _source=payload _key=$(sha256sum "$_payload" | cut -c1-16)
        elif [ -n "$_wheel" ]; then
            _source=wheel _key=$( (sha256sum "$_wheel"; ls "$_deps"/*.whl 2>/dev/null) | sha256sum | cut -c1-16)
        else
            echo "gpu_env.sh: SGLang does not import here and .whl/ holds neither the payload" \
                "sglang-0.5.23-gpu.tar.xz nor an sglang-0.5.23 wheel: build the payload with" \
                "'bash test/pack_gpu_payload.sh' on a machine with a network, or install SGLang 0.5.23" >&2
            unset _repo _payload _wheel _deps
            return 1
        fi
        _dir=${TMPDIR:-/tmp}/sglang-0.5.23-$_source-$_key
        if [ ! -d "$_dir" ]; then
            _partial=$(mktemp -d "$_dir.XXXXXX")
            if [ "$_source" = payload ]; then
                tar -xJf "$_payload" -C "$_partial"
            else  # without the dependency wheels, SGLang's files only (no runtime/)
                ls "$_deps"/*.whl >/dev/null 2>&1 || _deps=-
                PYTHONPATH="$_repo/python:$_repo/test" python3 -m support.gpu_payload stage \
                    "$_wheel" "$_deps" "$_partial"
            fi && mv -T "$_partial" "$_dir" || {
                rm -rf "$_partial"
                unset _repo _payload _wheel _deps _source _key _dir _partial
                return 1
            }
        fi
        echo "gpu_env.sh: SGLang does not import here; using SGLang's files from $([ "$_source" = payload ] && echo "$_payload" || echo "$_wheel")" >&2
        export GPU_SGLANG=$_source GPU_SGLANG_DIR=$_dir
        export PYTHONPATH="$_repo/python:$_repo/test:$_dir/files${PYTHONPATH:+:$PYTHONPATH}"
        unset _payload _wheel _deps _source _key _dir _partial
    fi
    unset _repo
fi
