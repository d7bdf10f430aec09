"""Fixtures shared by the DSA replay-metadata kernel tests."""

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_common as common
from sglang_dsa_mtp.testing.metadata_cases import WIDTH_1M


@pytest.fixture(params=[128, common.TILE_N], ids=["tile128", f"tile{common.TILE_N}-default"])
def tile_n(request, monkeypatch):
    """Run each CPU case with one-block tiles and with the default tile (256 columns): at the CPU
    width of 300, 3 and 2 tiles per full row, the last one partial."""
    monkeypatch.setattr(common, "TILE_N", request.param)
    return request.param


@pytest.fixture(params=["budget", "cap"], ids=["budget-7", "cap-2"])
def two_programs_per_request(request, monkeypatch):
    """The budget at which the 3 requests of ``STRIDING_LENGTHS`` get 2 programs each (fewer than
    their live tiles): from the budget itself (7 // 3), or from the cap of programs per request
    (``MAX_SPLITS_PER_REQUEST`` set to 2, under a budget that would allow 33333)."""
    if request.param == "cap":
        monkeypatch.setattr(common, "MAX_SPLITS_PER_REQUEST", 2)
        return 100_000
    return 7


@pytest.fixture(
    params=[
        (1, 300, None, None, 2),
        (3, 1100, 7, None, 2),
        (3, 1100, 100_000, 2, 2),
        (2, 1100, 100_000, None, 5),
        (8, 300, 1, None, 1),
    ],
    ids=[
        "default-budget-2-tiles-of-300",
        "budget-7-for-3-requests",
        "cap-2-per-request",
        "5-tiles-of-1100",
        "budget-below-requests",
    ],
)
def grid_case(request, monkeypatch):
    """(requests, width, budget, programs per request) of a launch at the default tile (256), the
    cap of programs per request set where one is given. Tile counts are ceilings: 300 and 1100
    columns are 2 and 5 tiles, not 1 and 4."""
    requests, width, budget, cap, programs = request.param
    if cap is not None:
        monkeypatch.setattr(common, "MAX_SPLITS_PER_REQUEST", cap)
    return requests, width, budget, programs


class _GridRecorder:
    """Stands in for a ``@triton.jit`` kernel: records the grid of every launch, then launches."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


@pytest.fixture
def launch_grids(monkeypatch):
    """The grid of every kernel launch of the four replay-metadata wrappers (decode, target verify,
    draft extend, the MTP one launch), in order."""
    grids = []
    for plans in (
        bounded._DECODE_PLANS,
        bounded._VERIFY_PLANS,
        bounded._DRAFT_EXTEND_PLANS,
        draft._PLANS,
    ):
        monkeypatch.setattr(plans, "kernel", _GridRecorder(plans.kernel, grids))
    return grids


@pytest.fixture(scope="module")
def req_to_token_1m():
    """A 40-slot pool of random token indices, SGLang's default 1M-token width, on the GPU."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randint(0, 1 << 30, (40, WIDTH_1M), dtype=torch.int32, generator=gen)
    return table.to("cuda")
