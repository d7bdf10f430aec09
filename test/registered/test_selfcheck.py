"""The self-check registry and the CUDA-graph timing helper the checks use."""

import math

import pytest
import torch

from sglang_dsa_mtp import selfcheck
from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.selfcheck import CheckResult, SelfCheck, cuda_graph_time_us, run_checks


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


@pytest.mark.parametrize("calls,replays", [(0, 30), (20, 0)])
def test_timing_rejects_empty_graphs(calls, replays):
    with pytest.raises(ValueError, match="at least 1"):
        cuda_graph_time_us(lambda: None, calls=calls, replays=replays)


@pytest.mark.gpu
@pytest.mark.parametrize("cold_l2", [False, True], ids=["hot-l2", "cold-l2"])
def test_timing_measures_the_captured_work_per_call(cold_l2):
    small = torch.randn(256, 256, device="cuda")
    large = torch.randn(4096, 4096, device="cuda")
    small_us = cuda_graph_time_us(lambda: small @ small, cold_l2=cold_l2)
    large_us = cuda_graph_time_us(lambda: large @ large, cold_l2=cold_l2)
    assert 0 < small_us < large_us and math.isfinite(large_us)
    # A 4096^3 fp32 matmul is 137 GFLOP: between 0.1 ms and 100 ms on any CUDA GPU.
    assert 100 < large_us < 100_000


@pytest.mark.gpu
def test_timing_replays_the_graph_not_the_python():
    calls = []
    x = torch.zeros(1, device="cuda")

    def fn():
        calls.append(1)
        x.add_(1)

    cuda_graph_time_us(fn, calls=3, replays=5)
    assert (
        len(calls) == 6
    ), "3 calls warm up outside the capture, 3 are captured, none run per replay"
    assert x.item() == 3 * (1 + 1 + 5), "run: the warm-up, one untimed replay, 5 timed replays"


def test_the_one_launch_mtp_draft_metadata_check_passes_on_this_device():
    """CPU here (small, through the interpreter); the GPU on the device machine (1M table, timed)."""
    [check] = [c for c in selfcheck.CHECKS if c.name == "one-launch MTP draft decode metadata"]
    device = select_device()
    result = check.fn(device)
    assert result.ok, result.detail
    assert (result.ours_us is not None) == (device.type == "cuda")
