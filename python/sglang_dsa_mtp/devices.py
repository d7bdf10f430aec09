"""What this machine offers: a CUDA device for the plugin's changes, or the CPU through Triton's
interpreter for its tests and self-checks.

:func:`cuda_blocker` is the one platform test every gate of the plugin asks (the changes are
CUDA-only; SGLang's ``is_cuda()`` and ``is_hip()`` decide the same way).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, that is when a kernel
module is imported. :func:`select_device` therefore has to run before any kernel module (ours, or an
SGLang reference loaded by the test support) is imported; asking torch first is fine, torch defines
no Triton kernels. The root ``conftest.py`` and ``python -m sglang_dsa_mtp`` both call it first.
"""

from __future__ import annotations

import os

import torch

H200_SMS = 132  # an H200's SMs: the figure status and tests use where no GPU says its own


def select_device() -> torch.device:
    """The CUDA device when there is one; otherwise the CPU, with ``TRITON_INTERPRET=1`` set."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def cuda_blocker() -> str | None:
    """Why the CUDA-only changes cannot engage in this process, or None when they can."""
    if torch.version.hip is not None:
        return f"HIP build of torch (ROCm {torch.version.hip}); the changes are CUDA-only"
    if torch.version.cuda is None or not torch.cuda.is_available():
        return "not a CUDA platform (no CUDA device)"
    return None
