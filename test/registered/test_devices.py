"""Device selection: the GPU when there is one, else the CPU through Triton's interpreter."""

import os

import pytest
import torch

from sglang_dsa_mtp.devices import cuda_blocker, select_device


@pytest.mark.quick
def test_without_cuda_the_cpu_is_selected_with_triton_interpret_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_device() == torch.device("cpu")
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_with_cuda_the_gpu_is_selected_and_triton_compiles(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_device() == torch.device("cuda")
    assert "TRITON_INTERPRET" not in os.environ


def test_the_changes_engage_only_on_a_cuda_build_with_a_device(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_blocker() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_blocker() == "not a CUDA platform (no CUDA device)"
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_blocker() == "not a CUDA platform (no CUDA device)"
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_blocker() == "HIP build of torch (ROCm 6.4.1); the changes are CUDA-only"
