#!/usr/bin/env bash
# Packs FlashMLA (package flash_mla of the sgl-flash-mla 1.0.0 wheel, which SGLang 0.5.23's
# sglang/kernels/ops/attention/flash_mla_interface.py imports) into .whl/ (ignored by git), for a
# CUDA machine without it or a network:
#
#   bash test/pack_flash_mla.sh [--no-strip]
#
# .whl/flash_mla-1.0.0.tar.xz   the flash_mla/ folder (its two CUDA extensions are abi3 builds:
#     any CPython >= 3.10; they need CUDA 13 and a torch with the stable ABI they were built for),
#     taken from the installed package, else from the wheel for CPython 3.12 that pip fetches;
#     its extensions stripped of their symbols (--no-strip keeps them), packed with xz.
# test/registered/kernels/ops/attention/test_flashmla_metadata_capture.py unpacks it once into
# $TMPDIR and imports it (GPU_FLASH_MLA_DIR=FOLDER or FILE.tar.xz points it elsewhere).
# Then prints what travels with one command (the payloads in .whl/ and the checkout) against the
# limit; needs strip (unless --no-strip) and xz.
set -euo pipefail
cd "$(dirname "$0")/.."

version=1.0.0
out=.whl/flash_mla-$version.tar.xz
strip_so=1
[ "${1:-}" = --no-strip ] && strip_so=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .whl "$work/pkg"

# The installed package, found without importing it (its import needs a CUDA driver).
installed=$(python3 -c '
import importlib.util
spec = importlib.util.find_spec("flash_mla")
print(list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else "")
')
if [ -n "$installed" ] && [ "$(cat "$installed/VERSION" 2>/dev/null)" = "$version" ]; then
    echo "flash_mla $version from $installed"
    cp -r "$installed" "$work/pkg/flash_mla"
else
    echo "flash_mla $version is not installed: fetching sgl-flash-mla==$version for CPython 3.12"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$work/dl" "sgl-flash-mla==$version"
    (cd "$work/pkg" && unzip -q "$work"/dl/sgl_flash_mla-*.whl 'flash_mla/*')
fi
rm -rf "$work/pkg/flash_mla/__pycache__"
if [ "$strip_so" = 1 ]; then
    strip --strip-unneeded "$work"/pkg/flash_mla/*.so
fi
echo "flash_mla/: $(du -sb "$work/pkg/flash_mla" | cut -f1) bytes; packing $out"
(cd "$work/pkg" && tar -cf - flash_mla) | xz -T0 -9e >"$out.partial"
mv "$out.partial" "$out"

sizes=()
for file in .whl/sglang-0.5.23-gpu.tar.xz .whl/triton-*-cp312-slim.tar.xz "$out"; do
    [ -f "$file" ] && sizes+=("$file")
done
PYTHONPATH="$PWD/test" python3 -m support.gpu_payload sizes "${sizes[@]}" ||
    echo "pack_flash_mla.sh: all of these do not fit in one transfer: leave the Triton tarball" \
        "behind (the FlashMLA test needs no Triton of its own)" >&2
