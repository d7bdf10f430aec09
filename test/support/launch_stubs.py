"""Launch plans on the CPU, made as on a GPU: for the tests of the plans and the host-time profile.

Triton's interpreter compiles nothing, so on the CPU no launch plan is ever kept. :func:`planned_on_cpu`
makes the four replay-metadata wrappers' plans behave as on a GPU: a JIT launch runs the kernel (in
the interpreter) and returns a stand-in compiled kernel whose launcher, called by a plan, records the
launch instead of running anything.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded

# The launch plans of the four replay-metadata wrappers (decode, target verify, draft extend, the
# MTP one launch).
ALL_PLANS = (
    bounded._DECODE_PLANS,
    bounded._VERIFY_PLANS,
    bounded._DRAFT_EXTEND_PLANS,
    draft._PLANS,
)


class _PlannedRecorder:
    """Stands in for a ``@triton.jit`` kernel on the CPU as it behaves on a GPU: a JIT launch runs
    the kernel (in the interpreter) and returns a compiled kernel whose launcher, called by a launch
    plan, records its grid instead of running."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            if self.launches is not None:
                self.launches.append(("jit", tuple(grid)))
            return _RecordingCompiled(self.launches)

        return jit

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class _RecordingCompiled:
    function = packed_metadata = None

    def __init__(self, launches):
        self.launches = launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, grid_x, grid_y, grid_z, *rest):
        if self.launches is not None:
            self.launches.append(("plan", (grid_x,)))


_CPU = SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: 0)


def planned_on_cpu(patch, launches: list | None) -> None:
    """Through ``patch`` (pytest's ``monkeypatch`` or a :class:`Patches`), make every launch of the
    four wrappers append ``("jit", grid)`` (kernel run, plan kept) or ``("plan", grid)`` (through a
    kept plan) to ``launches``, starting with no plans; with ``launches=None`` a plan's launcher
    does nothing at all (for timing)."""
    patch.setattr(launch, "DIRECT_LAUNCH", True)
    for plans in ALL_PLANS:
        patch.setattr(plans, "kernel", _PlannedRecorder(plans.kernel, launches))
        patch.setattr(plans, "driver", _CPU)
        patch.setattr(plans, "_plans", {})


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
