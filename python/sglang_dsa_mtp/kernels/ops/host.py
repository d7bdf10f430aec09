"""Host-side integer helpers for the kernel wrappers, which run before every CUDA-graph replay.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6 and 3.8: called
from Python they go through Triton's JIT call machinery, about 1.5 us each on the host, and a wrapper
calls them up to five times per launch. These return the same integers in plain Python (well under
0.1 us). :func:`default_budget` is every bounded launch's default program budget.
"""

from __future__ import annotations

import functools

import torch

PROGRAMS_PER_SM = 4  # the replay-metadata kernels' default budget on CUDA, per multiprocessor
CPU_DEFAULT_BUDGET = 64  # default budget for CPU tensors (Triton's interpreter)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``: ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n``, for ``n >= 1``: ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def default_budget(device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """The program budget of a bounded launch on ``device`` when its caller gives none:
    ``programs_per_sm`` per multiprocessor on CUDA."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return programs_per_sm * multiprocessor_count(index)
    return CPU_DEFAULT_BUDGET


@functools.lru_cache(maxsize=None)
def multiprocessor_count(index: int) -> int:
    """The SM count of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
