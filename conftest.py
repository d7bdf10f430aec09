"""Test session set-up shared by every test.

Without a CUDA device the tests run our Triton kernels and SGLang's through Triton's interpreter:
``select_device()`` sets ``TRITON_INTERPRET=1`` here, before any test module imports a kernel. Tests
marked ``gpu`` are skipped with a reason on such a machine.

Test modules that need SGLang installed (importing ``sglang`` imports its dependencies) start with
``pytest.importorskip("sglang.srt.plugins", reason=...)``. The GPU runner has only SGLang's files on
the path, for the reference kernels; there an import of ``sglang`` would fail and leave half of it in
``sys.modules``, so that the next import fails with a KeyError instead of an ImportError. So when the
``sglang`` distribution is not installed, ``sglang.srt.plugins`` is pinned to None: every import of it
raises ModuleNotFoundError at once, which ``importorskip`` reports as a skip.
"""

import sys
from importlib import metadata

import pytest

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()
GPU_SKIP_REASON = "needs a CUDA GPU (run test/run_gpu.sh on the device machine)"

try:
    SGLANG_VERSION = metadata.version("sglang")
except metadata.PackageNotFoundError:
    SGLANG_VERSION = None
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
    from sglang_dsa_mtp.integration import log
    from sglang_dsa_mtp.switches import SWITCHES

    for switch in SWITCHES:
        monkeypatch.delenv(switch.env, raising=False)
    monkeypatch.setattr(log, "_seen", set())
    return SWITCHES
