#!/usr/bin/env bash
# Packs, into .whl/ (ignored by git), what the GPU runner needs on a CUDA machine that has torch and
# triton but neither SGLang nor a network, small enough to travel beside the checkout (64 MiB in
# all), and proves the SGLang payload holds what the tests import:
#
#   bash test/pack_gpu_payload.sh [--triton VERSION]
#
# .whl/sglang-0.5.23-gpu.tar.xz   SGLang 0.5.23 for test/run_gpu.sh, test/gpu_env.sh and
#     test/gpu_sglang_env.sh (test/support/gpu_payload.py): its files/ folder is
#     SGLang's package without native files and unreached subtrees, its runtime/ folder SGLang's
#     metadata and the wheels of test/gpu_sglang_deps.txt unpacked. Built from SGLang's wheel for
#     CPython 3.12 (.whl/sglang-0.5.23-*.whl: only its Python and source files are used) and those
#     dependency wheels (.whl/sglang-deps/), each fetched with pip when absent; then checked (every
#     module reachable from the tests' imports is in files/, and the modules the tests name import
#     from it with the installed SGLang hidden) and packed with xz.
# .whl/triton-VERSION-cp312-slim.tar.xz   with --triton VERSION (when absent): Triton's wheel for
#     CPython 3.12 unpacked, libtriton.so stripped of its symbols, without CUPTI, proton, the
#     instrumentation, the AMD backend (and its entry point), the bundled ptxas (run_gpu.sh points
#     TRITON_PTXAS_PATH at the CUDA toolkit's), the disassemblers, FileCheck or the MLIR plugins
#     (only Triton's own tests and tools use them), packed with xz: 39 MB for 3.8.0.
# Then prints what travels with one command (the payload, the Triton tarball if there, the
# checkout) against the limit; fails past it.
#
# Run it from a checkout installed with `pip install -e ".[test]"` (SGLang 0.5.23 and its
# dependencies: the check imports SGLang's modules); it needs pip, and unzip, strip and xz for
# Triton. About 8 minutes on 2 cores, 5 more for Triton.
set -euo pipefail
cd "$(dirname "$0")/.."

triton_version=
if [ "${1:-}" = --triton ]; then
    triton_version=${2:?--triton needs a version, e.g. 3.8.0}
fi
pip_download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .whl

wheel=$(ls .whl/sglang-0.5.23-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    pip_download -d .whl sglang==0.5.23
    wheel=$(ls .whl/sglang-0.5.23-*.whl | head -n 1)
fi
if ! ls .whl/sglang-deps/*.whl >/dev/null 2>&1; then
    pip_download -d .whl/sglang-deps -r test/gpu_sglang_deps.txt
fi
export PYTHONPATH="$PWD/python:$PWD/test${PYTHONPATH:+:$PYTHONPATH}"
echo "staging SGLang's files from $wheel and the wheels of .whl/sglang-deps/"
python3 -m support.gpu_payload stage "$wheel" .whl/sglang-deps "$work/payload"
python3 -m support.gpu_payload check "$work/payload" "$wheel"
echo "packing .whl/sglang-0.5.23-gpu.tar.xz"
python3 -m support.gpu_payload pack "$work/payload" .whl/sglang-0.5.23-gpu.tar.xz
sizes=(.whl/sglang-0.5.23-gpu.tar.xz)

if [ -n "$triton_version" ]; then
    slim=.whl/triton-$triton_version-cp312-slim.tar.xz
    if [ ! -f "$slim" ]; then
        echo "packing $slim"
        pip_download -d "$work/dl" "triton==$triton_version"
        mkdir "$work/t" && (cd "$work/t" && unzip -q "$work"/dl/triton-*.whl)
        t=$work/t/triton
        strip --strip-unneeded "$t/_C/libtriton.so"
        rm -rf "$t"/backends/nvidia/lib/cupti* "$t"/backends/nvidia/bin/ptxas* "$t/_C/libproton.so" \
            "$t/instrumentation" "$t/backends/amd" "$t"/backends/nvidia/bin/{nvdisasm,cuobjdump} \
            "$t/FileCheck" "$t/plugins"
        sed -i '/^amd = /d' "$work"/t/triton-*.dist-info/entry_points.txt
        (cd "$work/t" && tar -cf - triton triton-*.dist-info) | xz -T0 -9 >"$slim.partial"
        mv "$slim.partial" "$slim"
    fi
fi
for slim in .whl/triton-*-cp312-slim.tar.xz; do
    [ -f "$slim" ] && sizes+=("$slim")
done
python3 -m support.gpu_payload sizes "${sizes[@]}"
