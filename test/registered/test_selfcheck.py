"""The self-check registry of ``python -m sglang_dsa_mtp``, and its checks passing on this device."""

import torch

from sglang_dsa_mtp import selfcheck
from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.selfcheck import SelfCheck, run_checks
from sglang_dsa_mtp.test.check import CheckResult


def test_run_checks_runs_every_check_in_order_on_the_given_device(monkeypatch):
    seen = []

    def check(name, ok):
        def fn(device):
            seen.append((name, device))
            return CheckResult(ok, name)

        return SelfCheck(name, fn)

    checks = (check("a", True), check("b", False))
    monkeypatch.setattr(selfcheck, "CHECKS", checks)
    cpu = torch.device("cpu")
    assert run_checks(cpu) == [
        (checks[0], CheckResult(True, "a")),
        (checks[1], CheckResult(False, "b")),
    ]
    assert seen == [("a", cpu), ("b", cpu)]


def test_a_check_that_raises_is_a_failed_check(monkeypatch):
    def broken(device):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(selfcheck, "CHECKS", (SelfCheck("broken", broken),))
    [(_, result)] = run_checks(torch.device("cpu"))
    assert result == CheckResult(False, "raised RuntimeError: out of resources")


def test_the_one_launch_mtp_draft_metadata_check_passes_on_this_device():
    """CPU here (small, through the interpreter); on a CUDA GPU, a 1M table, timed."""
    [check] = [c for c in selfcheck.CHECKS if c.name == "one-launch MTP draft decode metadata"]
    device = select_device()
    result = check.run(device)
    assert result.ok, result.detail
    assert (result.ours_us is not None) == (device.type == "cuda")
