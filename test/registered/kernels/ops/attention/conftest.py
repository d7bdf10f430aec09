"""Fixtures shared by the DSA replay-metadata kernel tests."""

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_common as common
from support.constants import WIDTH_1M
from support.launch_stubs import WRAPPERS


@pytest.fixture(params=[128, common.TILE_N], ids=["tile128", f"tile{common.TILE_N}-default"])
def tile_n(request, monkeypatch):
    """Run each CPU case with one-block tiles and with the default tile (1024 columns): at the CPU
    width of 300, 3 tiles and 1 per full row, the last one partial."""
    monkeypatch.setattr(common, "TILE_N", request.param)
    return request.param


@pytest.fixture(params=[2, 3], ids=["budget-2", "budget-3"])
def few_programs(request):
    """A budget of fewer programs than the live tiles of ``STRIDING_LENGTHS`` (2 + 1 + 1 at the
    default tile of 1024 columns, 9 + 5 + 2 at 128): programs take several tiles, across request
    boundaries, and a request's tiles go to several programs."""
    return request.param


@pytest.fixture(
    params=[
        (1, 300, None, 2),
        (3, 1100, 7, 7),
        (2, 1100, 100_000, 10),
        (8, 300, 1, 1),
        (3, 1100, 2, 2),
    ],
    ids=[
        "default-budget-2-tiles-of-300",
        "budget-7",
        "budget-above-the-10-tiles-of-2-rows-of-1100",
        "one-program",
        "fewer-programs-than-requests",
    ],
)
def grid_case(request, monkeypatch):
    """(requests, width, budget, tile programs) of a launch at a tile of 256 columns: the budget,
    or the batch's tiles at full width where fewer (tile counts are ceilings: 300 and 1100 columns
    are 2 and 5 tiles)."""
    monkeypatch.setattr(common, "TILE_N", 256)
    return request.param


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
    for _, module, name in WRAPPERS:
        monkeypatch.setattr(module, name, _GridRecorder(getattr(module, name), grids))
    return grids


@pytest.fixture(scope="module")
def req_to_token_1m():
    """A 40-slot pool of random token indices, SGLang's default 1M-token width, on the GPU."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randint(0, 1 << 30, (40, WIDTH_1M), dtype=torch.int32, generator=gen)
    return table.to("cuda")
