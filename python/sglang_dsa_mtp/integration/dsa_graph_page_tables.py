"""Hook site: the CUDA-graph state of the DSA backends (target, draft extend, MTP draft steps).

Behind ``SGLANG_DSA_LIVE_WIDTH``, in speculative decoding; what SGLang's kernels read is unchanged:

1. no wide ``page_table_1`` where nothing reads it: SGLang's own drop decision, its spec-decoding
   clause lifted; MTP step backends only where the one-launch draft-decode path owns their replay;
2. where the wide table stays, one ``real_page_table`` buffer per backend, sliced per captured bs;
3. the DSA target's verify tree mask (``dsa_verify_mask``), after SGLang's graph state.

Hooks: AROUND ``DeepseekSparseAttnBackend.init_cuda_graph_state`` (1, 2, 3) and BEFORE its
``_init_kpool_metadata_capture`` (2); AROUND the ``init_cuda_graph_state`` of
``DeepseekSparseAttnMultiStepBackend`` (1, the step backends). The two ``init_cuda_graph_state``
hooks are also the one owner of those methods for the bounded replay metadata and the metadata
glue: they drop what the plugin kept on the graph state being replaced (bound launches, the MTP
one launch's per-bs plans, glue graphs and keys), whichever of the three switches is on. Details: docs/switches.md, section "Live width: the verify tree mask
and the graph page tables".
"""

from __future__ import annotations

import logging

import torch

from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.dsa_metadata_glue import reset_glue
from sglang_dsa_mtp.integration.dsa_metadata_selection import KERNELS
from sglang_dsa_mtp.integration.dsa_mtp_draft_metadata import why_not_one_launch
from sglang_dsa_mtp.integration.dsa_verify_mask import create_verify_mask
from sglang_dsa_mtp.integration.fallback import fallback_of
from sglang_dsa_mtp.integration.state import BackendState, MultiStepState, peek, state_of
from sglang_dsa_mtp.log import gate_failure, log_failure, log_once
from sglang_dsa_mtp.switches import LIVE_WIDTH


def _role(backend) -> str:
    if backend.speculative_num_steps:
        return "draft step"
    return "speculative" if backend.speculative_num_draft_tokens else "decode"


def why_keep_wide_table(backend) -> str | None:
    """Why ``backend`` keeps its wide ``page_table_1`` whatever SGLang's own drop condition says, or
    None when SGLang's condition, with its spec-decoding clause lifted, may decide."""
    reason = why_off(LIVE_WIDTH)
    if reason is not None:
        return reason
    if not backend.speculative_num_draft_tokens:
        return "no speculative decoding: SGLang's own condition decides"
    if backend.speculative_num_steps:  # an MTP draft step backend
        return peek(backend, BackendState).step_reader
    return None


def sglang_reader(backend) -> str:
    """Which reader makes SGLang's own condition keep ``backend``'s wide table (for the logs)."""
    if backend.hisparse_coordinator is not None:
        return "HiSparse translates page_table_1"
    if backend.physical_page_size <= 1:
        return "page size 1: page_table_1 is the compact table itself"
    if backend.dsa_index_kpool > 1:
        return f"index_kpool {backend.dsa_index_kpool}: KPool's paged top-k mapping reads it"
    if not backend.use_fused_topk:
        return "unfused top-k (SGLANG_DSA_FUSE_TOPK=0, or PD index-share seeds) reads it"
    if not backend.dsa_topk_backend.should_use_topk_v2():
        return (
            f"the {backend.dsa_topk_backend.value} top-k backend without top-k v2 "
            "(SGLANG_OPT_USE_TOPK_V2) transforms through it"
        )
    if not 0 < (backend.dsa_index_topk or 0) <= 2048:
        return f"index top-k {backend.dsa_index_topk} is outside top-k v2's (0, 2048]"
    return "SGLang's drop condition is false"


def _sglang_drop_decides(original, backend, args, kwargs) -> None:
    """``init_cuda_graph_state`` with SGLang's spec-decoding clause lifted; on any error, stock."""
    spec_tokens = backend.speculative_num_draft_tokens
    backend.speculative_num_draft_tokens = 0
    try:
        original(backend, *args, **kwargs)
        return
    except Exception as exc:  # never take the server down: run SGLang's spec-mode allocation
        log_failure(
            ("drop-wide-failed", type(exc).__name__, str(exc)),
            exc,
            "sglang_dsa_mtp: the DSA graph state keeps SGLang's wide page_table_1",
        )
    finally:
        backend.speculative_num_draft_tokens = spec_tokens
    original(backend, *args, **kwargs)


def init_graph_state(original, backend, max_bs, max_num_tokens, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnBackend.init_cuda_graph_state`` (SGLang's graph state made anew:
    at start-up and at every recapture): what was kept on the graph state being replaced is
    dropped first (the launches bound on its buffers, each batch size bound again at its capture;
    the metadata glue's graphs and keys, captured again with the new graphs); then items 1, 2 and 3
    above (each gated on live width)."""
    for attr, _, _ in KERNELS:
        fallback = fallback_of(getattr(backend, attr, None))
        if fallback is not None:
            fallback.bound.clear()
    reset_glue(backend, BackendState)
    args = (max_bs, max_num_tokens, *args)
    try:
        reason = why_keep_wide_table(backend)
    except Exception as exc:  # never take the server down: SGLang decides alone
        reason = gate_failure(exc, "a DSA backend keeps SGLang's spec-mode graph page tables")
    if reason is None:
        _sglang_drop_decides(original, backend, args, kwargs)
    else:
        original(backend, *args, **kwargs)
    state = state_of(backend, BackendState)
    state.shared_real_page_table = None
    if backend.dsa_drop_wide_page_table:
        if reason is None:
            log_once(
                logging.INFO,
                ("drop-wide", _role(backend)),
                "sglang_dsa_mtp: %s backend: no wide page_table_1 in the CUDA graph state "
                "(nothing reads it)",
                _role(backend),
            )
    else:
        if reason is None or not backend.speculative_num_draft_tokens:
            reason = sglang_reader(backend)
        log_once(
            logging.INFO,
            ("keep-wide", _role(backend), reason),
            "sglang_dsa_mtp: %s backend keeps its wide page_table_1: %s",
            _role(backend),
            reason,
        )
        state.shared_real_page_table = _shared_real_page_table(backend, max_num_tokens)
    create_verify_mask(backend, max_bs)
    return None


def _shared_real_page_table(backend, max_num_tokens: int):
    """One zeroed compact table for every captured batch size of ``backend``, or None."""
    if why_off(LIVE_WIDTH) is not None or backend.physical_page_size <= 1:
        return None
    page = backend.physical_page_size
    width = backend.req_to_token.shape[1]
    return torch.zeros(
        max_num_tokens, (width + page - 1) // page, dtype=torch.int32, device=backend.device
    )


def capture_into_shared_real_table(backend, metadata, *args, **kwargs):
    """BEFORE ``_init_kpool_metadata_capture``, which SGLang calls on each captured batch size's new
    ``DSAMetadata`` before storing it: its ``real_page_table`` becomes a slice of the shared buffer,
    holding the values SGLang computed."""
    shared = peek(backend, BackendState).shared_real_page_table
    table = metadata.real_page_table
    if shared is None or table is None or table is metadata.page_table_1:
        return None
    try:
        rows, cols = table.shape
        if cols != shared.shape[1] or rows > shared.shape[0] or table.dtype != shared.dtype:
            raise ValueError(
                f"real_page_table {tuple(table.shape)} {table.dtype} does not fit the shared "
                f"{tuple(shared.shape)} {shared.dtype} buffer"
            )
        view = shared[:rows]
        view.copy_(table)
        object.__setattr__(metadata, "real_page_table", view)
    except Exception as exc:  # never take the server down: the batch size keeps its own table
        log_failure(
            ("shared-real-failed", type(exc).__name__, str(exc)),
            exc,
            "sglang_dsa_mtp: a captured batch size keeps its own real_page_table",
        )
    return None


def why_steps_keep_wide_table(multi) -> str | None:
    """Why the MTP draft step backends must keep ``page_table_1`` for SGLang's precompute + copies,
    or None when the one-launch path owns their replay."""
    reason = why_not_one_launch(multi)
    if reason is not None:
        return f"SGLang's draft-decode precompute + copies read it (no one launch: {reason})"
    return None


def steps_graph_state(original, multi, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.init_cuda_graph_state``: forget the one launch's
    plans and the metadata glue of the graph state being replaced (each batch size is decided and
    captured again at its capture), tell
    each step backend whether the one-launch path owns the replay, then note whether any step lost
    its table."""
    state_of(multi, MultiStepState).batch_sizes.clear()
    reset_glue(multi, MultiStepState)
    try:
        reason = why_steps_keep_wide_table(multi)
    except Exception as exc:  # never take the server down: the steps keep their tables
        reason = gate_failure(exc, "the MTP draft step backends keep their wide page_table_1")
    for backend in multi.attn_backends:
        state_of(backend, BackendState).step_reader = reason
    original(multi, *args, **kwargs)
    state_of(multi, MultiStepState).steps_dropped = any(
        getattr(backend, "dsa_drop_wide_page_table", False) for backend in multi.attn_backends
    )
