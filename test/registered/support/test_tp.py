"""The raw NCCL TP harness's torch symmetric-memory arm: skipped only where it cannot exist.

``tp.make_all_reduce("symm_mem", ...)`` raises ``ArmUnavailable`` (the test's skip) only for the
reason ``symm_mem_unavailable`` gives; any other error setting the arm up reaches the test as
itself. On the CPU: a one-rank gloo group, and torch's own set-up error for a CPU tensor.
"""

import pytest
import torch
import torch.distributed as dist

from support import tp

GPU_0 = torch.device("cuda", 0)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_symm_mem_set_up_error_fails_instead_of_skipping(one_rank_group, monkeypatch):
    monkeypatch.setattr(tp, "symm_mem_unavailable", lambda device, world: None)
    with pytest.raises(RuntimeError, match="SymmetricMemory does not support device type cpu"):
        tp.make_all_reduce("symm_mem", 16, torch.device("cpu"))


@pytest.mark.quick
def test_the_symm_mem_arm_is_skipped_with_the_reason_it_cannot_exist(one_rank_group, monkeypatch):
    seen = []

    def no_p2p(device, world):
        seen.append((device, world))
        return "GPU 0 cannot access the memory of GPU [1] (no P2P)"

    monkeypatch.setattr(tp, "symm_mem_unavailable", no_p2p)
    with pytest.raises(tp.ArmUnavailable) as raised:
        tp.make_all_reduce("symm_mem", 16, GPU_0)
    assert str(raised.value) == (
        "torch symmetric memory one-shot all-reduce: GPU 0 cannot access the memory of GPU [1] "
        "(no P2P)"
    )
    assert seen == [(GPU_0, 1)]


def test_symm_mem_cannot_exist_where_a_peer_gpu_has_no_p2p_access(monkeypatch):
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: peer != 2)
    assert tp.symm_mem_unavailable(GPU_0, 4) == (
        "GPU 0 cannot access the memory of GPU [2] (no P2P)"
    )
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: True)
    assert tp.symm_mem_unavailable(GPU_0, 4) is None
