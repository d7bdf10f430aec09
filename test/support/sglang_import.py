"""Which test modules run: SGLang installed means SGLang must import.

A test module that needs SGLang's runtime starts with ``require_sglang()``. Where the ``sglang``
distribution is not installed (a CUDA machine with only SGLang's files from the wheel, for the
reference kernels), the module is skipped with a reason. Where it is installed, importing
``sglang.srt.plugins`` (which imports SGLang's dependencies) must work: a broken dependency raises
here and the module errors, instead of some 200 tests turning silently into skips.

The GPU tests that need SGLang's runtime on a machine without its dependencies installed ask
:func:`sglang_runtime_missing` (``test/gpu_sglang_env.sh`` provides them) and skip with its reason.
:func:`modules_requiring_sglang` lists the test modules that call ``require_sglang()``: the GPU
runner (``test/run_gpu.sh``) runs them apart, in SGLang's environment, and the others without it.
``python -m support.sglang_import PATH...`` prints them, one a line.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

import pytest

NOT_INSTALLED = "needs SGLang with its dependencies installed (the sglang distribution is not)"
# Top-level modules that importing SGLang needs and that a bare GPU machine lacks.
SGLANG_IMPORTS = ("pydantic", "zmq", "orjson", "msgspec", "tvm_ffi", "IPython", "openai", "fastapi")


def sglang_version():
    """The installed ``sglang`` distribution's version, or None."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def require_sglang() -> None:
    """Skip the calling module where SGLang is not installed; import SGLang where it is."""
    version = sglang_version()
    if version is None:
        pytest.skip(NOT_INSTALLED, allow_module_level=True)
    try:
        import sglang.srt.plugins  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"sglang {version} is installed but `import sglang.srt.plugins` failed ({e}): "
            "the tests that need SGLang cannot run; repair the installation"
        ) from e


def sglang_runtime_missing():
    """Why SGLang cannot be imported in a test's worker processes here, or None."""
    if sglang_version() is None:
        return "SGLang's distribution metadata is not on the path"
    missing = [name for name in SGLANG_IMPORTS if importlib.util.find_spec(name) is None]
    if missing:
        return f"SGLang's dependencies {missing} are not importable"
    return None


def calls_require_sglang(path: Path) -> bool:
    """Whether the Python file at ``path`` calls ``require_sglang()`` anywhere."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require_sglang":
            return True
    return False


def modules_requiring_sglang(paths) -> list[Path]:
    """The test modules (``test_*.py``) at or under ``paths`` that call ``require_sglang()``,
    sorted; a path that does not exist raises FileNotFoundError naming it."""
    found = set()
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such test path: {path}")
        candidates = [path] if path.is_file() else path.rglob("test_*.py")
        found.update(p for p in candidates if p.name.startswith("test_") and p.suffix == ".py")
    return sorted(p for p in found if calls_require_sglang(p))


if __name__ == "__main__":
    for module in modules_requiring_sglang(sys.argv[1:] or ["test/registered"]):
        print(module)
