# Source to import SGLang 0.5.23 itself on a CUDA machine without SGLang or a network: the test
# modules that need SGLang's runtime, and the benchmarks built on it.
#
#   source test/gpu_sglang_env.sh && python3 -m pytest -m gpu test/registered/integration/test_dsa_indexer_live_logits.py
#
# Sources test/gpu_env.sh (this package and SGLang's files on PYTHONPATH). Where SGLang is installed,
# that is all. Otherwise it adds the runtime/ folder gpu_env.sh unpacked from .whl/ (SGLang's
# distribution metadata and the packages of test/gpu_sglang_deps.txt: the payload of
# test/pack_gpu_payload.sh has it, SGLang's wheel has it with .whl/sglang-deps/), and this package's
# own metadata with its entry point, so that SGLang's plugin loader finds it (the plugin registers
# only for the SGLang version it was tested with, read from SGLang's metadata). SGLang's native
# packages (sgl_kernel) stay absent: pytest sessions get them stubbed before any test module is
# imported (PYTEST_ADDOPTS gains -p support.sglang_stubs), and the TP harness
# (test/support/tp.py) stubs them in its processes; calling a stub raises.
#
# Exports GPU_SGLANG_RUNTIME (the folders added). Sourcing it again does nothing.

if [ -z "${GPU_SGLANG_RUNTIME:-}" ]; then
    _here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    source "$_here/test/gpu_env.sh" || { unset _here; return 1; }
    if [ "$GPU_SGLANG" = installed ]; then
        export GPU_SGLANG_RUNTIME=installed
    elif [ ! -d "$GPU_SGLANG_DIR/runtime" ]; then
        echo "gpu_sglang_env.sh: no SGLang runtime: put the payload sglang-0.5.23-gpu.tar.xz" \
            "(bash test/pack_gpu_payload.sh) in .whl/, or the wheels of test/gpu_sglang_deps.txt" \
            "in .whl/sglang-deps/ (fetched as that file says)" >&2
        unset _here
        return 1
    else
        # This package's metadata, as `pip install` writes it: its name, version and entry points.
        _meta=$GPU_SGLANG_DIR/plugin-$(sha256sum "$_here/pyproject.toml" | cut -c1-16)
        if [ ! -d "$_meta" ]; then
            python3 - "$_here/pyproject.toml" "$_meta.partial" <<'PY' && mv -T "$_meta.partial" "$_meta" || { unset _here _meta; return 1; }
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
info = Path(sys.argv[2], f"{project['name'].replace('-', '_')}-{project['version']}.dist-info")
info.mkdir(parents=True)
info.joinpath("METADATA").write_text(
    f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
)
groups = project.get("entry-points", {})
info.joinpath("entry_points.txt").write_text(
    "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
        for group, points in groups.items()
    )
)
PY
        fi
        export GPU_SGLANG_RUNTIME="$GPU_SGLANG_DIR/runtime:$_meta"
        export PYTHONPATH="$PYTHONPATH:$GPU_SGLANG_RUNTIME"
        export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }-p support.sglang_stubs"
        echo "gpu_sglang_env.sh: SGLang's runtime from $GPU_SGLANG_DIR/runtime, native packages stubbed" >&2
        unset _meta
    fi
    unset _here
fi
