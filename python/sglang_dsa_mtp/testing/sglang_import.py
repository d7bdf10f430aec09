"""Which test modules run: SGLang installed means SGLang must import.

A test module that needs SGLang's runtime starts with ``require_sglang()``. Where the ``sglang``
distribution is not installed (a CUDA machine with only SGLang's files from the wheel, for the
reference kernels), the module is skipped with a reason. Where it is installed, importing
``sglang.srt.plugins`` (which imports SGLang's dependencies) must work: a broken dependency raises
here and the module errors, instead of some 200 tests turning silently into skips.

The GPU tests that need SGLang's runtime on a machine without its dependencies installed ask
:func:`sglang_runtime_missing` (``test/gpu_sglang_env.sh`` provides them) and skip with its reason.
"""

import importlib.util
from importlib import metadata

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
