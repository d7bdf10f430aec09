#!/usr/bin/env bash
# Fetches DeepGEMM for a CUDA machine without it or a network (FlashMLA: bash
# test/pack_flash_mla.sh; SGLang's JIT kernels build there with nvcc and ninja) into .whl/real-ops/
# (ignored by git):
#
#   bash test/pack_real_ops.sh
#
# - the sgl-deep-gemm wheels of test/support/real_ops.py's DEEP_GEMM_VERSIONS (SGLang 0.5.23's pin
#   0.2.3.post2, and the older 0.2.0 and 0.1.5.post3 with the same paged-MQA functions): one
#   build for every CPython; support/real_ops.py imports the first that loads and answers.
# - sgl_kernel-0.4.10-sm90.tar.xz: the sglang-kernel 0.4.10 wheel SGLang 0.5.23 pins, its Python
#   and SM90 common_ops only (12 MB; its 1.1 GB flash_ops and the other libraries stay behind).
# Then prints what travels with one command (the payloads in .whl/) against the limit.
set -euo pipefail
cd "$(dirname "$0")/.."

out=.whl/real-ops
mkdir -p "$out"
versions=$(python3 -c '
import ast, pathlib
tree = ast.parse(pathlib.Path("test/support/real_ops.py").read_text())
for node in tree.body:
    if isinstance(node, ast.Assign) and node.targets[0].id == "DEEP_GEMM_VERSIONS":
        print(" ".join(ast.literal_eval(node.value)))
')
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
for version in $versions; do
    python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" \
        --python-version 3.12 -d "$out" "sgl-deep-gemm==$version"
done
if [ ! -f "$out/sgl_kernel-0.4.10-sm90.tar.xz" ]; then
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" \
        --python-version 3.12 -d "$work" "sglang-kernel==0.4.10"
    (cd "$work" && unzip -q sglang_kernel-*.whl 'sgl_kernel/*' -x 'sgl_kernel/*.so' \
        && unzip -q sglang_kernel-*.whl sgl_kernel/sm90/common_ops.abi3.so \
        && tar -cf - sgl_kernel) | xz -T0 -9 >"$out/sgl_kernel-0.4.10-sm90.tar.xz"
    rm -rf "$work"
fi
ls -l "$out"
du -ch .whl/*.tar.xz "$out" | tail -n 1 | awk '{print "what travels from .whl/: " $1 " (one command carries at most 64 MiB)"}'
