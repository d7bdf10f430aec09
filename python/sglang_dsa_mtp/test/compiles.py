"""Counting Triton JIT compiles, for the tests that no kernel compiles on the serving path.

A compile here is what Triton's ``jit_post_compile_hook`` reports: a miss in a kernel's in-process
cache, which builds the kernel (from Triton's disk cache when it holds it, else from source) and loads
it, milliseconds to seconds on the host. Triton's interpreter compiles nothing: counts are meaningful
on a GPU only. Triton 3.4 to 3.8 (``triton.knobs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import triton


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Inside the block, every Triton JIT compile appends the kernel's name to the yielded list
    (any hook installed before keeps being called)."""
    compiled: list[str] = []
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        compiled.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")))
        if previous is not None:
            return previous(*args, **kwargs)
        return None

    runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_post_compile_hook = previous


def forget_compiled(*kernels) -> None:
    """Drop the in-process compiled variants of ``kernels`` (``@triton.jit`` functions), so that
    their next launch per variant compiles again (from Triton's disk cache) and is counted; no-op
    under Triton's interpreter, which keeps no compiled variants."""
    for kernel in kernels:
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            caches.clear()
