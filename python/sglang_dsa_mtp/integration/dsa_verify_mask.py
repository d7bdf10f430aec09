"""Hook site: the EAGLE verify tree mask of the DSA target backend.

SGLang 0.5.23's ``DeepseekSparseAttnBackend`` has no ``verify_mask``, so every round
``build_eagle_verify_input`` allocates and fills a FULL_MASK ``bs x max_context_len x draft_tokens``
mask that DSA's attention never reads. Behind ``SGLANG_DSA_LIVE_WIDTH`` the target gets what
SGLang's FlashMLA backend builds: a preallocated QLEN_ONLY mask marked not read, into which the
worker writes the tree through its fused chain-tree kernel. Only with EAGLE topk 1, no watermark
and no two-batch overlap; elsewhere ``verify_mask`` is None, as stock. Hooks: AFTER ``__init__``
(records whether the backend is a draft runner's; SGLang does not store it) and the attribute row
``verify_mask`` (a property shadowing ``AttentionBackend.verify_mask``); ``dsa_graph_page_tables``
calls :func:`create_verify_mask`. Details, every reader of the mask: docs/switches.md, section "The
verify tree mask".
"""

from __future__ import annotations

import inspect
import logging

from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
from sglang.srt.runtime_context import get_exec, get_spec

from sglang_dsa_mtp.hooks import why_off
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
    reason = why_off(LIVE_WIDTH)
    if reason is not None:
        return reason
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
