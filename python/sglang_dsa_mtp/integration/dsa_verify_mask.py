"""Hook site: the EAGLE verify tree mask of the DSA target backend.

SGLang 0.5.23's ``DeepseekSparseAttnBackend`` has no ``verify_mask`` (it inherits
``AttentionBackend.verify_mask``, None), so ``build_eagle_verify_input`` builds the tree mask in the
GPU default layout, FULL_MASK: every round it allocates and ``torch.full``s ``bs x max_context_len x
draft_tokens`` bools (``seq_lens_sum`` is None: DSA sets ``needs_cpu_seq_lens = False``). DSA's
attention never reads that mask (it attends through the indexer's top-k). Here the DSA target gets
what SGLang's FlashMLA backend builds in ``init_cuda_graph_state``: a preallocated QLEN_ONLY mask
marked not read (``maybe_create_verify_mask(..., is_read=False)``). The worker then writes the
``bs x draft_tokens x draft_tokens`` tree into it, and with ``--speculative-eagle-topk 1`` takes its
fused chain-tree kernel (``build_chain_tree``), which also prepares the verify ``out_cache_loc``.

Readers of the mask's cells in 0.5.23, and what happens to each:

- the DSA attention backend: none (no ``custom_mask`` anywhere in ``dsa_backend.py`` or ``dsa/``);
- the watermark (``--enable-watermark``: ``eagle_sample`` hands the mask and its layout to
  ``WatermarkState``): the mask stays stock;
- two-batch overlap (``--enable-two-batch-overlap``: ``split_spec_info`` slices the mask with
  FULL_MASK offsets): the mask stays stock;
- tree drafts (``--speculative-eagle-topk`` above 1) keep the mask stock: only the chain draft's
  verify inputs are checked equal under both layouts;
- grammar (``GrammarTree`` reads the ``retrieve_*`` arrays, not the mask), verify and accept
  (``verify_tree_greedy`` reads ``retrieve_*`` and the candidates), the single-node verify input of
  ``eagle_worker_v2`` and the PP relay (both handle either layout): unaffected.

The AFTER hook on ``__init__`` records whether the backend belongs to a draft runner (SGLang does
not store it); the live-width hook on ``init_cuda_graph_state`` (``dsa_graph_page_tables``) calls
:func:`create_verify_mask` after SGLang's graph state is built; the attribute row ``verify_mask`` (a
property on ``DeepseekSparseAttnBackend`` shadowing ``AttentionBackend.verify_mask``) hands the mask
out. It is None, as stock, wherever no mask was created.
"""

from __future__ import annotations

import inspect
import logging

from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
from sglang.srt.runtime_context import get_exec, get_spec

from sglang_dsa_mtp.integration.state import BackendState, peek, state_of
from sglang_dsa_mtp.log import log_failure, log_once
from sglang_dsa_mtp.switches import LIVE_WIDTH


def remember_runner(result, backend, *args, **kwargs):
    """AFTER ``DeepseekSparseAttnBackend.__init__``: keep what ``maybe_create_verify_mask`` needs."""
    bound = inspect.signature(DeepseekSparseAttnBackend.__init__).bind(backend, *args, **kwargs)
    bound.apply_defaults()
    runner = bound.arguments["model_runner"]
    state_of(backend, BackendState).runner = (
        bool(getattr(runner, "is_draft_worker", False)),
        bool(bound.arguments["skip_prefill"]),
    )
    return result


def _verify_mask(backend):
    return peek(backend, BackendState).verify_mask


# The attribute row: DeepseekSparseAttnBackend.verify_mask (shadows AttentionBackend.verify_mask).
verify_mask = property(_verify_mask, doc="The QLEN_ONLY, not-read verify mask, or None (stock).")


def why_not_verify_mask(backend) -> str | None:
    """Why this backend keeps SGLang's verify path (no mask of its own), or None."""
    blocker = LIVE_WIDTH.blocker()
    if blocker is not None:
        return blocker
    runner = peek(backend, BackendState).runner
    if runner is None:
        return "the backend was built before the plugin's hooks applied"
    is_draft, skip_prefill = runner
    if is_draft or skip_prefill:
        return "a draft backend: only the target verifies"
    if not backend.speculative_num_draft_tokens:
        return "no speculative decoding"
    if get_spec().speculative_eagle_topk != 1:
        return (
            "--speculative-eagle-topk is not 1 (only the chain draft's verify inputs are checked)"
        )
    features = get_exec().features
    if features.enable_watermark:
        return "the watermark (--enable-watermark) reads the tree mask"
    if get_exec().overlap.enable_two_batch_overlap:
        return "two-batch overlap (--enable-two-batch-overlap) slices the mask as FULL_MASK"
    return None


def create_verify_mask(backend, max_bs: int) -> None:
    """After SGLang's ``init_cuda_graph_state``: the target's not-read mask, or none (stock)."""
    state = state_of(backend, BackendState)
    state.verify_mask = None
    try:
        reason = why_not_verify_mask(backend)
        if reason is None:
            is_draft, skip_prefill = state.runner
            state.verify_mask = maybe_create_verify_mask(
                is_draft_runner=is_draft,
                skip_prefill=skip_prefill,
                max_bs=max_bs,
                max_context_len=backend.max_context_len,
                num_draft_tokens=backend.speculative_num_draft_tokens,
                device=backend.device,
                is_read=False,
            )
    except Exception as exc:  # never take the server down: no mask is SGLang's path
        state.verify_mask = None
        log_failure(
            ("verify-mask-failed", type(exc).__name__, str(exc)),
            exc,
            "sglang_dsa_mtp: the DSA verify mask keeps SGLang's FULL_MASK path",
        )
        return
    if reason is None:
        log_once(
            logging.INFO,
            ("verify-mask-on",),
            "sglang_dsa_mtp: the DSA target's verify tree mask is QLEN_ONLY, not read "
            "(max bs %d, %d draft tokens)",
            max_bs,
            backend.speculative_num_draft_tokens,
        )
    elif not reason.startswith("a draft backend"):
        log_once(
            logging.INFO,
            ("verify-mask-off", reason),
            "sglang_dsa_mtp: the DSA verify tree mask stays SGLang's (FULL_MASK): %s",
            reason,
        )
