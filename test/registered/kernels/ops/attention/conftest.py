"""Fixtures shared by the DSA replay-metadata kernel tests."""

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.test.metadata_cases import WIDTH_1M


@pytest.fixture(params=[128, 1024], ids=["tile128", "tile1024"])
def tile_n(request, monkeypatch):
    """Run each CPU case with one-block tiles (many strided iterations) and the default tile."""
    monkeypatch.setattr(bounded, "TILE_N", request.param)
    return request.param


@pytest.fixture(scope="module")
def req_to_token_1m():
    """A 40-slot pool of random token indices, SGLang's default 1M-token width, on the GPU."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randint(0, 1 << 30, (40, WIDTH_1M), dtype=torch.int32, generator=gen)
    return table.to("cuda")
