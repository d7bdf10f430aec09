"""On the GPU: the verify inputs SGLang's fused chain-tree path gives a DSA target with the plugin's
QLEN_ONLY mask equal those of today's FULL_MASK path, at the spec's 1M-token context.

``support.verify_tree``: SGLang's ``build_chain_tree`` into a preallocated QLEN_ONLY mask
against SGLang's FULL_MASK sequence (the ``torch.full`` mask, its tree builder, and the verify cache
locations of ``assign_extend_cache_locs_uniform_func``), SGLang's kernels loaded from its files. The
draft tokens, positions, ``retrieve_*`` arrays, cache locations (dtype included) and the tree cells of
the masks are equal, and so is SGLang's greedy verify (predictions, accept index, accept length) on
target picks that accept a random prefix of each chain. On the CPU the same holds through SGLang's
real ``build_eagle_verify_input`` (``test/registered/integration/test_dsa_verify_mask.py``).
"""

import pytest
import torch

from support.constants import CONTEXT_1M
from support.verify_tree import (
    chain_draft,
    chain_verify,
    differences,
    greedy_accept,
    stock_verify,
)

pytestmark = pytest.mark.gpu

CONTEXT = CONTEXT_1M
MAX_BS = 48


def lengths(bs: int, steps: int, seed: int) -> list[int]:
    """Edge lengths first (0, 1, around a page and a 128 block, the widest a verify may reach),
    then random ones up to the context."""
    edges = [0, 1, 63, 64, 65, 127, 128, 129, CONTEXT - steps - 1]
    generator = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, CONTEXT - steps, (max(0, bs - len(edges)),), generator=generator)
    return (edges + extra.tolist())[:bs]


@pytest.mark.parametrize("steps", [4, 5], ids=["eagle-4-1-5", "eagle-5-1-6"])
@pytest.mark.parametrize("bs", [1, 9, 16, 48])
def test_the_chain_tree_gives_the_stock_verify_inputs_and_accepts_the_same_tokens(steps, bs):
    tokens = steps + 1
    draft = chain_draft(
        lengths(bs, steps, seed=bs),
        [(7 * i) % 50 for i in range(bs)],
        steps=steps,
        width=CONTEXT + 4 + tokens,
        max_context_len=CONTEXT,
        seed=bs + steps,
    )
    buffer = torch.zeros(MAX_BS * tokens * tokens, dtype=torch.bool, device="cuda")
    ours, stock = chain_verify(draft, buffer), stock_verify(draft)
    assert differences(draft, ours, stock) == []
    generator = torch.Generator().manual_seed(bs)
    target = torch.randint(0, 154880, (bs, tokens), generator=generator).cuda()
    accepted = torch.randint(0, tokens, (bs,), generator=generator)
    for row, n in enumerate(accepted.tolist()):
        target[row, :n] = ours["draft_token"].view(bs, tokens)[row, 1 : 1 + n]
    for a, b in zip(greedy_accept(ours, draft, target), greedy_accept(stock, draft, target)):
        assert torch.equal(a, b)
