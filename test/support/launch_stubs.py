"""Bound launches on the CPU, made as on a GPU: for the tests of the launch path and the host-time
profile.

Triton's interpreter compiles nothing, so on the CPU no launch is ever bound. :func:`compiled_on_cpu`
makes the four replay-metadata wrappers' kernels behave as on a GPU: ``kernel[grid](...)`` (the JIT)
runs the kernel in the interpreter, and ``kernel.warmup(...)`` returns a stand-in compiled kernel
whose launch, ``compiled[grid](*every_parameter_value)``, runs the kernel in the interpreter with
those values by parameter position (so an argument at another parameter's position writes other
outputs). Each launch is recorded as ``(kind, op)``: kind "jit" or "bound".
"""

from __future__ import annotations

import contextlib

from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded

# The four replay-metadata wrappers (decode, target verify, draft extend, the MTP one launch), each
# with the module global it launches its kernel through.
WRAPPERS = (
    (bounded.fused_dsa_decode_metadata_bounded, bounded, "bounded_decode_metadata_kernel"),
    (
        bounded.fused_dsa_target_verify_metadata_bounded,
        bounded,
        "_bounded_target_verify_metadata_kernel",
    ),
    (
        bounded.fused_dsa_draft_extend_metadata_bounded,
        bounded,
        "_bounded_draft_extend_metadata_kernel",
    ),
    (draft.fused_dsa_draft_decode_metadata_multi, draft, "bounded_decode_metadata_kernel"),
)
BINDERS = tuple(wrapper.binder for wrapper, _, _ in WRAPPERS)


class StandInKernel:
    """A ``@triton.jit`` kernel on the CPU as it behaves on a GPU, for the op ``what``: the JIT runs
    it (in the interpreter; nothing at all while ``runs`` is False: for timing); ``warmup`` returns
    :attr:`compiled`, one per kernel (Triton's cache returns one compiled kernel per variant).
    Everything else is the kernel's."""

    def __init__(self, kernel, what: str, launches: list | None):
        self.kernel, self.what, self.launches = kernel, what, launches
        self.runs = True
        self.compiled = StandInCompiled(self)

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            if self.runs:
                self.kernel[grid](*args, **kwargs)
            self.record("jit")
            return self.compiled

        return jit

    def warmup(self, *args, grid, **kwargs):
        return self.compiled

    def record(self, kind: str) -> None:
        if self.launches is not None:
            self.launches.append((kind, self.what))

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class StandInCompiled:
    """A compiled kernel's stand-in: ``compiled[grid](*values)`` runs the kernel with ``values`` by
    parameter position (as its :class:`StandInKernel` runs); its ``run`` is no CUDA launcher, so no
    C launch is made of it."""

    function = packed_metadata = run = None

    def __init__(self, kernel: StandInKernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def runner(*values, stream=None):
            if self.kernel.runs:
                self.kernel.kernel[grid](*values)
            self.kernel.record("bound")

        return runner


def compiled_on_cpu(patch, launches: list | None) -> dict[str, StandInKernel]:
    """Through ``patch`` (pytest's ``monkeypatch`` or a :class:`Patches`), every kernel of the four
    wrappers a :class:`StandInKernel` recording into ``launches`` (None: nothing recorded), as the
    wrapper and its binder hold it; returns them by op."""
    stand_ins = {}
    for wrapper, module, name in WRAPPERS:
        binder = wrapper.binder
        stand_in = StandInKernel(getattr(module, name), binder.what, launches)
        patch.setattr(module, name, stand_in)
        patch.setattr(binder, "kernel", stand_in)
        stand_ins[binder.what] = stand_in
    return stand_ins


class Patches(contextlib.AbstractContextManager):
    """``setattr`` that the ``with`` block's end undoes, for scripts (tests use ``monkeypatch``)."""

    def __init__(self):
        self._undo = []

    def setattr(self, target, name, value) -> None:
        self._undo.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def __exit__(self, *exc):
        for target, name, value in reversed(self._undo):
            setattr(target, name, value)
        self._undo.clear()
