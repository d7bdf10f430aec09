"""The metadata glue's shared memory pool on a GPU: what a glue capture allocates lands in the one
pool every glue graph shares, and the probe made with the pool says why not where it would not.

Torch picks, for an allocation inside a capture, among the pools of the captures under way by its
own search order; the glue relies on the pool made current last (``torch.cuda.use_mem_pool``) being
picked over the capture's own. Off a GPU there is no pool: ``test_dsa_metadata_glue.py`` tests that
a failed probe keeps every prep eager.
"""

import contextlib

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp.integration import dsa_metadata_glue as glue

pytestmark = pytest.mark.gpu


def gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())  # as the glue's pool is made


def test_every_allocation_of_two_glue_captures_lands_in_the_shared_pool():
    assert glue._pool_probe(torch.cuda.MemPool(), gpu()) is None


def test_the_probe_says_why_where_each_capture_keeps_its_own_pool(monkeypatch):
    """The negative control: the pool never made current, each capture's allocations go to the
    graph's own pool, and the probe names it."""
    monkeypatch.setattr(
        torch.cuda, "use_mem_pool", lambda pool, device=None: contextlib.nullcontext()
    )
    reason = glue._pool_probe(torch.cuda.MemPool(), gpu())
    assert reason is not None and "put 2 of 2 probe allocations" in reason, reason
