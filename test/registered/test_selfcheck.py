"""Running the self-checks of ``python -m sglang_dsa_mtp``: every check in order, a raising check a
failed one. (The checks themselves: ``testing/test_selfchecks.py``.)"""

import pytest
import torch

from sglang_dsa_mtp.selfcheck import CheckResult, SelfCheck, run_checks


@pytest.mark.quick
def test_run_checks_runs_every_check_in_order_on_the_given_device():
    seen = []

    def check(name, ok):
        def fn(device):
            seen.append((name, device))
            return CheckResult(ok, name)

        return SelfCheck(name, fn)

    checks = (check("a", True), check("b", False))
    cpu = torch.device("cpu")
    assert run_checks(checks, cpu) == [
        (checks[0], CheckResult(True, "a")),
        (checks[1], CheckResult(False, "b")),
    ]
    assert seen == [("a", cpu), ("b", cpu)]


def test_a_check_that_raises_is_a_failed_check():
    def broken(device):
        raise RuntimeError("out of resources")

    [(_, result)] = run_checks((SelfCheck("broken", broken),), torch.device("cpu"))
    assert result == CheckResult(False, "raised RuntimeError: out of resources")
