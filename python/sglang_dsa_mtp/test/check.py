"""What one self-check of ``python -m sglang_dsa_mtp`` returns (see :mod:`sglang_dsa_mtp.selfcheck`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckResult:
    """``ok``, a one-line ``detail``, and on the GPU the microseconds per call of each arm."""

    ok: bool
    detail: str
    ours_us: float | None = None
    sglang_us: float | None = None
