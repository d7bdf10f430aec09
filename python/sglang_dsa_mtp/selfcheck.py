"""Kernel self-checks run by ``python -m sglang_dsa_mtp``: ours against SGLang 0.5.23's own.

Each row of ``CHECKS`` names a check in the test support (:mod:`sglang_dsa_mtp.test`), which
compares one of our kernels with SGLang's on random inputs, bit for bit, on the device it is given:
the GPU (at real sizes, with a CUDA-graph timing of each arm) or the CPU through Triton's
interpreter (at small sizes, untimed). The check is imported only when it runs, after
``select_device()``, so importing this module defines no Triton kernel.
"""

from __future__ import annotations

import pkgutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch

from sglang_dsa_mtp.test.check import CheckResult

_CASES = "sglang_dsa_mtp.test"


@dataclass(frozen=True)
class SelfCheck:
    """One row: ``check`` maps a device to a :class:`CheckResult`; given as ``"<module>:<function>"``,
    it is imported when the check runs."""

    name: str
    check: Union[str, Callable[[torch.device], CheckResult]]

    def run(self, device: torch.device) -> CheckResult:
        check = pkgutil.resolve_name(self.check) if isinstance(self.check, str) else self.check
        return check(device)


CHECKS: tuple[SelfCheck, ...] = (
    SelfCheck(
        "bounded DSA replay metadata", f"{_CASES}.metadata_cases:check_bounded_replay_metadata"
    ),
    SelfCheck(
        "one-launch MTP draft decode metadata",
        f"{_CASES}.metadata_cases:check_draft_decode_metadata",
    ),
    SelfCheck(
        "draft argmax partials + finalize", f"{_CASES}.argmax_cases:check_draft_argmax_exchange"
    ),
    SelfCheck("live-width indexer logits (chunked)", f"{_CASES}.indexer_cases:check_live_logits"),
)


def run_checks(device: torch.device) -> list[tuple[SelfCheck, CheckResult]]:
    """Run every check in ``CHECKS`` on ``device``; a check that raises is a failed check."""
    results = []
    for check in CHECKS:
        try:
            result = check.run(device)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            result = CheckResult(False, f"raised {type(exc).__name__}: {exc}")
        results.append((check, result))
    return results
