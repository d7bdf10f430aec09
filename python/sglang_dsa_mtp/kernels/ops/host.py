"""Host-side integer helpers for the kernel wrappers, which run before every CUDA-graph replay.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6 and 3.8: called
from Python they go through Triton's JIT call machinery, about 1.5 us each on the host, and a wrapper
calls them up to five times per launch. These return the same integers in plain Python (well under
0.1 us).
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``: ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n``, for ``n >= 1``: ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()
