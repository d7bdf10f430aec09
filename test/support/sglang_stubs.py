"""Stand-ins for SGLang's native dependencies that the GPU TP harness never calls (test support only).

A CUDA machine with only torch, triton and CUDA's compiler has none of SGLang's native kernel
packages, and may have no network to install them from. Importing SGLang's TP group, ``LogitsProcessor``,
``ParallelLMHead`` and the modules the plugin hooks (the EAGLE v2 worker, the DSA backend) on CUDA
imports ``sgl_kernel`` at module level (quantization schemes, KV-cache I/O, scalar types), though the
path the harness runs (the TP group's communicators, the LM-head GEMM, the logits gather, the plugin's
Triton kernels, SGLang's Triton ``draft_topk1_postprocess``) calls none of it.

:func:`install_native_stubs` makes each package in :data:`NATIVE_STUBS` that is not installed
importable as a stand-in: every submodule imports, every attribute resolves (to a class, so that
SGLang can subclass or index it at import time), and calling or instantiating anything raises
``RuntimeError("... is stubbed in the test harness")``, so a path that does reach one fails loudly
instead of computing something else. A package that is installed is never stubbed. The plugin and
the serving path never import this module; :func:`support.tp.sglang_nccl_tp_group`
installs the stubs before it imports SGLang, and so does a pytest session started with
``-p support.sglang_stubs`` (:func:`pytest_configure`: ``test/gpu_sglang_env.sh``
puts that in ``PYTEST_ADDOPTS``) before it imports any test module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Native packages that SGLang 0.5.23 imports at module level on CUDA along the harness's imports.
NATIVE_STUBS = ("sgl_kernel",)


class _StubAttributeType(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_attribute(f"{cls.__qualname__}.{name}")


def _stub_attribute(qualname: str) -> type:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{qualname} is stubbed in the test harness (its package is absent)")

    module, _, name = qualname.rpartition(".")
    return _StubAttributeType(
        name, (), {"__init__": refuse, "__qualname__": qualname, "__module__": module}
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_attribute(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_native_stubs(packages: tuple[str, ...] = NATIVE_STUBS) -> tuple[str, ...]:
    """Stub each of ``packages`` that is not installed; returns the ones stubbed (idempotent)."""
    for finder in sys.meta_path:
        if isinstance(finder, _StubFinder):
            return finder.packages
    missing = tuple(name for name in packages if importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing


def stubbed(package: str) -> bool:
    """Whether ``package`` is one of the stand-ins :func:`install_native_stubs` installed."""
    return any(
        isinstance(finder, _StubFinder) and package in finder.packages for finder in sys.meta_path
    )


def pytest_configure(config):
    """As a pytest plugin: the stubs are in place before collection imports a test module."""
    install_native_stubs()
