"""What this machine offers our kernels: a CUDA device, or the CPU through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, that is when a kernel
module is imported. ``select_device()`` therefore has to run before any kernel module (ours, or an
SGLang reference loaded by ``reference.py``) is imported; asking torch first is fine, torch does not
define Triton kernels. The root ``conftest.py`` and ``python -m sglang_dsa_mtp`` both call it first.
"""

from __future__ import annotations

import os

import torch


def select_device() -> torch.device:
    """The CUDA device when there is one; otherwise the CPU, with ``TRITON_INTERPRET=1`` set."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def cuda_blocker() -> str | None:
    """Why the CUDA-only changes cannot engage on this machine, or None when they can."""
    if torch.version.hip is not None:
        return f"HIP build of torch (ROCm {torch.version.hip}); the changes are CUDA-only"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None
