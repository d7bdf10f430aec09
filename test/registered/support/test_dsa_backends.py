"""The test support's SGLang DSA backends (``support.dsa_backends``): what stands in for a native
op SGLang 0.5.23 calls and does what the op does."""

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from support import dsa_backends as kit


@pytest.mark.quick
def test_the_torch_logits_read_only_the_pages_a_rows_length_reaches():
    """DeepGEMM's logits stand-in (``dsa_backends.torch_logits``): SGLang's torch logits over a
    table whose entries past each row's length name no page of the pool (what a replay prep may
    leave there) give SGLang's own scores of the same table with those entries 0, bit for bit,
    where SGLang's function alone reads past the pool."""
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    gen = torch.Generator().manual_seed(0)
    rows, heads, pages, width = 4, 8, 6, 5
    q = torch.randn(rows, 1, heads, 128, generator=gen).to(torch.float8_e4m3fn)
    values = torch.randn(pages, 64 * 128, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(pages, 64, generator=gen) + 0.5
    cache = torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], 1)
    cache = cache.view(pages, 64, 1, 132)
    weights = torch.randn(rows, heads, generator=gen)
    lengths = torch.tensor([1, 64, 65, 5 * 64], dtype=torch.int32)
    table = torch.randint(0, pages, (rows, width), generator=gen, dtype=torch.int32)
    reached = torch.arange(width)[None, :] * 64 < lengths[:, None]
    clean = table.masked_fill(~reached, 0)
    stale = table.masked_fill(~reached, pages + 1000)
    args = (q, cache, weights, lengths)
    expected = fp8_paged_mqa_logits_torch(*args, clean, None, width * 64, clean_logits=False)
    with pytest.raises(IndexError):
        fp8_paged_mqa_logits_torch(*args, stale, None, width * 64, clean_logits=False)
    logits = kit.live_pages(fp8_paged_mqa_logits_torch)
    got = logits(*args, stale, None, width * 64, clean_logits=False)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert expected.abs().sum() > 0
