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
ls -l "$out"
du -ch .whl/*.tar.xz "$out" | tail -n 1 | awk '{print "what travels from .whl/: " $1 " (one command carries at most 64 MiB)"}'
