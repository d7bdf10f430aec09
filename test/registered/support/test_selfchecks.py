"""Every self-check of ``python -m sglang_dsa_mtp`` passes: untimed on the CPU (CI), timed against
SGLang on a GPU (``test/run_gpu.sh``)."""

import pytest
import torch

from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.selfcheck import SelfCheck
from support.selfchecks import CHECKS

DEVICE = select_device()
CHECK_NAMES = [check.name for check in CHECKS]
SLOW_ON_THE_CPU = {"draft argmax partials + finalize"}  # about a minute through the interpreter


def registered(name: str) -> SelfCheck:
    [check] = [c for c in CHECKS if c.name == name]
    return check


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in SLOW_ON_THE_CPU else pytest.mark.quick) for n in CHECK_NAMES],
)
def test_each_check_passes_untimed_on_the_cpu(name):
    """Small cases through Triton's interpreter: what ``python -m sglang_dsa_mtp`` runs in CI."""
    if DEVICE.type == "cuda":
        pytest.skip(
            "the CPU branch runs through Triton's interpreter, which is off on a GPU machine"
        )
    result = registered(name).check(torch.device("cpu"))
    assert result.ok, result.detail
    assert (result.ours_us, result.sglang_us) == (None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_each_check_passes_timed_against_sglang_on_a_gpu(name):
    """The GPU branch: SGLang's default sizes (1M-token table, vocab 154880), both arms timed."""
    result = registered(name).check(torch.device("cuda"))
    assert result.ok, result.detail
    assert result.ours_us > 0 and result.sglang_us > 0, result
