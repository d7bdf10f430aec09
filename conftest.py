"""Test session set-up shared by every test.

Without a CUDA device the tests run our Triton kernels and SGLang's through Triton's interpreter:
``select_device()`` sets ``TRITON_INTERPRET=1`` here, before any test module imports a kernel. Tests
marked ``gpu`` are skipped with a reason on such a machine.

Test modules that need SGLang's runtime start with ``require_sglang()``
(``support.sglang_import``): skipped with a reason where the ``sglang`` distribution is
not installed, an error where it is installed and does not import. On a CUDA machine without
SGLang's dependencies the GPU runner has only SGLang's files on the path (from the wheel, for the
reference kernels); there an import of ``sglang`` would fail and leave half of it in
``sys.modules``, so that the next import fails with a KeyError instead of an ImportError. So when the
distribution is not installed, ``sglang.srt.plugins`` is also pinned to None: any import of it
raises ModuleNotFoundError at once.
"""

import pkgutil
import sys

import pytest

from sglang_dsa_mtp.devices import select_device
from support.sglang_import import sglang_version

DEVICE = select_device()
GPU_SKIP_REASON = "needs a CUDA GPU (run test/run_gpu.sh on a CUDA machine)"

SGLANG_VERSION = sglang_version()
if SGLANG_VERSION is None:
    sys.modules["sglang.srt.plugins"] = None


def pytest_report_header(config):
    if SGLANG_VERSION is None:
        return "sglang: not installed, modules that import it are skipped"
    return f"sglang: {SGLANG_VERSION} installed"


def pytest_collection_modifyitems(config, items):
    if DEVICE.type == "cuda":
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_switches(monkeypatch):
    """Both kill switches unset (default on), with the once-per-process log memory empty."""
    from sglang_dsa_mtp import log
    from sglang_dsa_mtp.integration import dsa_indexer_live_logits
    from sglang_dsa_mtp.switches import SWITCHES

    for switch in SWITCHES:
        monkeypatch.delenv(switch.env, raising=False)
    monkeypatch.setattr(log, "_seen", set())
    monkeypatch.setattr(dsa_indexer_live_logits, "_FAILED", {})
    return SWITCHES


@pytest.fixture
def triton_release(monkeypatch):
    """``triton_release("3.9.0")``: a fresh copy of ``kernels.ops.launch``, imported while Triton
    reports that release, and the module in use given that copy's ``TRITON_VERSION`` (what it reads
    from the release at import), restored after the test; returns the copy. The module in use is never re-imported, so every reference
    to it stays valid."""
    import importlib.util

    import triton

    from sglang_dsa_mtp.kernels.ops import launch

    def use(version: str):
        with monkeypatch.context() as patch:
            patch.setattr(triton, "__version__", version)
            spec = importlib.util.spec_from_file_location("_launch_under_test", launch.__file__)
            fresh = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(fresh)
        monkeypatch.setattr(launch, "TRITON_VERSION", fresh.TRITON_VERSION)
        return fresh

    return use


# --- hook sites: SGLang's real plugin loader has applied our real tables ---------------------------
# SGLang is imported inside these fixtures, so that collecting the tests where SGLang's files are on
# the path without its dependencies (test/gpu_env.sh from the wheel) leaves the skipping to each
# module's ``importorskip``.


@pytest.fixture
def set_platform(monkeypatch):
    """``set_platform(cuda=..., hip=...)``: what SGLang's and our hook sites see as the platform."""
    from support.dsa_backends import set_platform

    return lambda *, cuda, hip: set_platform(monkeypatch, cuda=cuda, hip=hip)


@pytest.fixture
def sglang_targets_restored(monkeypatch):
    """Every SGLang attribute the plugin's table hooks is restored after the test (with the module
    copies SGLang rebinds), and the attributes the plugin added to SGLang classes are removed."""
    from sglang_dsa_mtp import hooks

    for row in hooks.HOOKS:
        owner_path, _, attr = row.target.rpartition(".")
        owner = pkgutil.resolve_name(owner_path)
        # A method the class inherits is hooked on the class itself: undoing deletes it again.
        original = vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)
        monkeypatch.setattr(owner, attr, original)
        # SGLang rebinds ``from X import f`` copies of a hooked function in every module: restore them.
        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is original and module is not owner:
                    monkeypatch.setattr(module, name, original)
    added = []
    for row in hooks.ATTRIBUTES:
        owner_path, _, attr = row.target.rpartition(".")
        owner = pkgutil.resolve_name(owner_path)
        if attr not in vars(owner):
            added.append((owner, attr))
    yield
    for owner, attr in added:
        if attr in vars(owner):
            delattr(owner, attr)


@pytest.fixture
def hooked(fresh_switches, monkeypatch, sglang_targets_restored):
    """SGLang's ``load_plugins()`` has run our ``register()`` with the real tables and applied the
    hooks, on a CUDA platform (``dsa_backends.load_plugin``); everything is restored afterwards
    (``sglang_targets_restored``)."""
    from support.dsa_backends import load_plugin

    load_plugin(monkeypatch)
    return monkeypatch
