"""Counting Triton JIT compiles, for the GPU tests that check nothing compiles on the serving path.

    from support.compiles import count_compiles, forget_compiled

    forget_compiled(kernel_a, kernel_b)  # their next launches compile again
    with count_compiles() as warm:
        warm_up(...)
    with count_compiles() as sweep:
        ...  # every launch the serving path makes
    assert sweep.names == [], sweep.describe()
    assert warm.of(kernel_a) >= 1

:func:`count_compiles` records every compile of any ``@triton.jit`` kernel in the block through
Triton's post-compile hook (``triton.knobs.runtime.jit_post_compile_hook``, in Triton 3.6 and 3.8),
which Triton calls once per new specialization a process compiles, or loads from its on-disk cache.
Under Triton's interpreter (``TRITON_INTERPRET=1``) nothing compiles and nothing is counted: the
tests that use this are GPU tests. Imports only triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import triton


@dataclass
class Compiles:
    """The compiles seen in one :func:`count_compiles` block, in order."""

    names: list[str] = field(default_factory=list)  # "module.kernel" per compile
    signatures: list[str] = field(default_factory=list)  # Triton's description of each
    kernels: list[object] = field(default_factory=list)  # the JITFunction per compile

    def of(self, kernel) -> int:
        """How many compiles were of ``kernel`` (a ``@triton.jit`` function)."""
        return sum(1 for compiled in self.kernels if compiled is kernel)

    def describe(self) -> str:
        return "; ".join(self.signatures) or "no compiles"


def _hook_slot():
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        raise RuntimeError(
            f"Triton {triton.__version__} has no triton.knobs.runtime.jit_post_compile_hook "
            "(Triton 3.6 and 3.8 have it)"
        )
    return runtime


@contextlib.contextmanager
def count_compiles() -> Iterator[Compiles]:
    """Record every Triton JIT compile in the block. A hook installed before is still called, and
    is put back on exit."""
    runtime = _hook_slot()
    previous = runtime.jit_post_compile_hook
    seen = Compiles()

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        module = getattr(fn, "module", "")
        seen.names.append(f"{getattr(module, '__name__', module)}.{getattr(fn, 'name', '?')}")
        seen.signatures.append(str(kwargs.get("repr", "?")))
        seen.kernels.append(getattr(fn, "jit_function", None))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_post_compile_hook = previous


def forget_compiled(*kernels) -> None:
    """Drop the variants of ``kernels`` this process has compiled (their per-device JIT caches),
    so that their next launches compile again, as in a fresh server process. Kernels Triton
    interprets have no such cache and are left as they are."""
    from triton.runtime.jit import JITFunction

    for kernel in kernels:
        if not isinstance(kernel, JITFunction):
            continue
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            raise RuntimeError(
                f"Triton {triton.__version__}'s JITFunction has no device_caches to forget"
            )
        caches.clear()
