"""The kernel self-checks of ``python -m sglang_dsa_mtp``: what one check returns, and running them.

A check compares one of our kernels with SGLang 0.5.23's own on random inputs, bit for bit, on the
device it is given: the GPU (at real sizes, with a CUDA-graph timing of each arm) or the CPU through
Triton's interpreter (at small sizes, untimed). The checks themselves are test support
(``support.selfchecks.CHECKS``), which the command line hands to :func:`run_checks`
after ``select_device()``; this module imports none of it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckResult:
    """``ok``, a one-line ``detail``, and on the GPU the microseconds per call of each arm."""

    ok: bool
    detail: str
    ours_us: float | None = None
    sglang_us: float | None = None


@dataclass(frozen=True)
class SelfCheck:
    """One row: ``check`` maps a device to a :class:`CheckResult`."""

    name: str
    check: Callable[[torch.device], CheckResult]


def run_checks(
    checks: Sequence[SelfCheck], device: torch.device
) -> list[tuple[SelfCheck, CheckResult]]:
    """Run every check on ``device``; a check that raises is a failed check (traceback on stderr)."""
    results = []
    for check in checks:
        try:
            result = check.check(device)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            result = CheckResult(False, f"raised {type(exc).__name__}: {exc}")
        results.append((check, result))
    return results
