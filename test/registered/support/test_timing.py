"""The CUDA-graph timing the self-checks, GPU tests and benchmarks share (``support.timing``)."""

import math

import pytest
import torch

from support.timing import cuda_graph_time_us


@pytest.mark.quick
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
