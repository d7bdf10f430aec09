"""The wrappers' host-side integer helpers give Triton's own results."""

import pytest
import triton

from sglang_dsa_mtp.kernels.ops.host import cdiv, next_power_of_2


@pytest.mark.quick
def test_cdiv_matches_triton():
    for a in [0, 1, 2, 127, 128, 129, 1023, 1 << 20, 1_048_640, (1 << 31) + 5]:
        for b in [1, 2, 3, 64, 128, 256, 4096]:
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in [*range(1, 5000), (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 1_048_640]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
