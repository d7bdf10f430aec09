"""The self-check registry of ``python -m sglang_dsa_mtp``, and every check passing: untimed on the
CPU (CI), timed against SGLang on a GPU (``test/run_gpu.sh``)."""

import pytest
import torch

from sglang_dsa_mtp import selfcheck
from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.selfcheck import SelfCheck, run_checks
from sglang_dsa_mtp.test.check import CheckResult

DEVICE = select_device()


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


CHECK_NAMES = [check.name for check in selfcheck.CHECKS]


def registered(name: str) -> SelfCheck:
    [check] = [c for c in selfcheck.CHECKS if c.name == name]
    return check


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_each_check_passes_untimed_on_the_cpu(name):
    """Small cases through Triton's interpreter: what ``python -m sglang_dsa_mtp`` runs in CI."""
    if DEVICE.type == "cuda":
        pytest.skip(
            "the CPU branch runs through Triton's interpreter, which is off on a GPU machine"
        )
    result = registered(name).run(torch.device("cpu"))
    assert result.ok, result.detail
    assert (result.ours_us, result.sglang_us) == (None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_each_check_passes_timed_against_sglang_on_a_gpu(name):
    """The GPU branch: SGLang's default sizes (1M-token table, vocab 154880), both arms timed."""
    result = registered(name).run(torch.device("cuda"))
    assert result.ok, result.detail
    assert result.ours_us > 0 and result.sglang_us > 0, result
