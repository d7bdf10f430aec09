"""The verify inputs of a topk=1 EAGLE chain draft, the two ways SGLang 0.5.23 builds them for a DSA
target: without a verify mask (today) and with the plugin's QLEN_ONLY, not-read mask.

* :func:`stock_verify`: what ``build_eagle_verify_input`` does for a target without a verify mask
  (``tree_mask_mode`` FULL_MASK, ``seq_lens_sum`` unknown): ``build_tree_kernel_efficient`` allocates
  and ``torch.full``s a FULL_MASK sized ``bs x max_context_len x draft tokens`` (plus the tree
  cells), the ``retrieve`` and ``positions`` buffers and the token cat, and runs SGLang's tree
  builder; ``eagle_prepare_for_verify`` then assigns the verify cache locations
  (``assign_extend_cache_locs_uniform_func``).
* :func:`chain_verify`: what it does with the QLEN_ONLY mask on CUDA: SGLang's fused
  ``build_chain_tree`` into the preallocated mask, which also returns the cache locations.

SGLang's kernels come from its files (``reference.speculative_module``), bound to its Triton
implementations: SGLang's CUDA tree builder is a JIT build (its Triton builder, SGLang's XPU path,
stands in). On the CPU the tests run SGLang's real ``build_eagle_verify_input`` instead
(``test/registered/integration/test_dsa_verify_mask.py``); these functions serve the GPU test and
the benchmark, where SGLang itself cannot be imported.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from support.reference import speculative_module

FIELDS = ("draft_token", "positions", "retrieve_index", "retrieve_next_token")
FIELDS += ("retrieve_next_sibling", "out_cache_loc")


def chain_draft(
    seq_lens, req_pool_indices, *, steps, width, max_context_len, seed=0, device="cuda"
):
    """One topk=1 draft round: SGLang's chain ``parent_list`` / ``top_scores_index`` (the EAGLE
    worker's ``_rebuild_topk1_chain_buffers``), random bonus and draft tokens, a random
    ``req_to_token`` pool ``width`` columns wide."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (a chain with parents), got {steps}")
    generator = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    pool = max(req_pool_indices) + 1
    return SimpleNamespace(
        bs=bs,
        steps=steps,
        tokens=steps + 1,
        max_context_len=max_context_len,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
        req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64).to(device),
        req_to_token=torch.randint(0, 1 << 30, (pool, width), generator=generator).int().to(device),
        bonus=torch.randint(0, 154880, (bs,), generator=generator).to(device),
        draft_tokens=torch.randint(0, 154880, (bs, steps), generator=generator).to(device),
        parent_list=torch.arange(-1, steps - 1).repeat(bs, 1).to(device),
        top_scores_index=torch.arange(steps).repeat(bs, 1).to(device),
    )


def full_mask_numel(draft) -> int:
    """FULL_MASK cells SGLang allocates for an unknown ``seq_lens_sum`` (``bs x max_context_len``)."""
    return draft.bs * draft.max_context_len * draft.tokens + draft.tokens**2 * draft.bs


def stock_verify(draft) -> dict:
    """Today's verify inputs for a DSA target (no verify mask), as SGLang builds them."""
    spec_tree = speculative_module("spec_tree")
    cache_locs = speculative_module("cache_locs")
    device = draft.seq_lens.device
    tokens = draft.tokens
    tree_mask = torch.full((full_mask_numel(draft),), True, dtype=torch.bool, device=device)
    retrieve = torch.full((3, draft.bs, tokens), -1, dtype=torch.long, device=device)
    positions = torch.empty((draft.bs * tokens,), dtype=torch.long, device=device)
    draft_token = torch.cat((draft.bonus.unsqueeze(1), draft.draft_tokens), dim=1).flatten()
    spec_tree.build_tree_kernel_efficient_func(
        draft.parent_list,
        draft.top_scores_index,
        draft.seq_lens,
        tree_mask,
        positions,
        *retrieve,
        1,
        draft.steps,
        tokens,
        spec_tree.TreeMaskMode.FULL_MASK,
    )
    out_cache_loc = cache_locs.assign_extend_cache_locs_uniform_func(
        req_pool_indices=draft.req_pool_indices,
        req_to_token=draft.req_to_token,
        start_offset=draft.seq_lens,
        batch_size=draft.bs,
        draft_token_num=tokens,
        device=device,
    )
    return dict(
        tree_mask=tree_mask,
        draft_token=draft_token,
        positions=positions,
        retrieve_index=retrieve[0],
        retrieve_next_token=retrieve[1],
        retrieve_next_sibling=retrieve[2],
        out_cache_loc=out_cache_loc,
    )


def chain_verify(draft, mask_buffer: torch.Tensor) -> dict:
    """The verify inputs with the QLEN_ONLY mask: SGLang's ``build_chain_tree`` into ``mask_buffer``."""
    mask, positions, index, next_token, sibling, tokens, out_cache_loc, _ = speculative_module(
        "eagle"
    ).build_chain_tree(
        draft.bonus,
        draft.draft_tokens,
        draft.seq_lens,
        mask_buffer,
        req_pool_indices=draft.req_pool_indices,
        req_to_token=draft.req_to_token,
        with_mrope=False,
    )
    return dict(
        tree_mask=mask,
        draft_token=tokens,
        positions=positions,
        retrieve_index=index,
        retrieve_next_token=next_token,
        retrieve_next_sibling=sibling,
        out_cache_loc=out_cache_loc,
    )


def differences(draft, ours: dict, stock: dict) -> list[str]:
    """What differs between the two: every verify input, dtype included, and the tree cells of the
    two masks (QLEN_ONLY against FULL_MASK's tree columns)."""
    diffs = [
        name
        for name in FIELDS
        if ours[name].dtype != stock[name].dtype or not torch.equal(ours[name], stock[name])
    ]
    tokens, offset, trees = draft.tokens, 0, []
    for n in draft.seq_lens.tolist():
        block = stock["tree_mask"][offset : offset + tokens * (n + tokens)]
        trees.append(block.view(tokens, n + tokens)[:, n:])
        offset += tokens * (n + tokens)
    qlen = ours["tree_mask"][: draft.bs * tokens * tokens].view(draft.bs, tokens, tokens)
    if not torch.equal(qlen, torch.stack(trees)):
        diffs.append("tree_mask (tree cells)")
    return diffs


def greedy_accept(verify: dict, draft, target_predict: torch.Tensor):
    """SGLang's greedy tree verify (``verify_tree_greedy_func``) of these inputs."""
    spec_tree = speculative_module("spec_tree")
    device = draft.seq_lens.device
    tokens = draft.tokens
    predict = torch.zeros(draft.bs * tokens, dtype=torch.int32, device=device)
    accept_index = torch.full((draft.bs, draft.steps + 1), -1, dtype=torch.int32, device=device)
    accept_len = torch.empty(draft.bs, dtype=torch.int32, device=device)
    return spec_tree.verify_tree_greedy_func(
        predict,
        accept_index,
        accept_len,
        verify["draft_token"].reshape(draft.bs, tokens),
        verify["retrieve_index"],
        verify["retrieve_next_token"],
        verify["retrieve_next_sibling"],
        target_predict,
        topk=1,
    )
