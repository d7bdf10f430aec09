"""Hook site: the CUDA-graph page tables of the DSA backends (target, draft extend, MTP draft steps).

SGLang 0.5.23's ``DeepseekSparseAttnBackend.init_cuda_graph_state`` allocates, per backend, either a
wide ``[max_rows, width]`` int32 ``page_table_1`` (width = ``req_to_token``'s, ~1M columns at the
default context) from which every captured batch size derives a fresh compact ``real_page_table``
(``[rows, cdiv(width, page)]``, kept for the life of the graph), or, when nothing reads the wide
table (``dsa_drop_wide_page_table``), no wide table and one compact buffer sliced per batch size.
SGLang drops it only outside speculative decoding. Here, behind ``SGLANG_DSA_LIVE_WIDTH``:

1. **No wide table where nothing reads it.** In spec mode SGLang's own drop decision runs with its
   spec-decoding clause lifted (the backend is presented as non-speculative for the duration of
   ``init_cuda_graph_state``; SGLang's condition sees spec decoding only through
   ``speculative_num_draft_tokens``), so SGLang's own condition and allocation decide, for the
   target and the draft-extend backend. Its condition keeps the table wherever a reader is engaged:
   HIP, HiSparse, page size 1, KPool > 1 (the paged top-k mapping), unfused top-k (including PD
   index-share seeds), a top-k backend other than sgl-kernel with top-k v2, or an index top-k
   outside (0, 2048]. In spec mode one more reader exists, on the MTP draft step backends only:
   SGLang's draft-decode precompute and its copies (``_precompute_replay_metadata``,
   ``fused_metadata_copy_*``, ``_copy_base_replay_buffers``). So the step backends drop their
   tables only when the plugin's one-launch draft-decode path owns their replay
   (``SGLANG_DSA_BOUNDED_REPLAY_METADATA`` on, its hooks applied, its static conditions met); should
   the one launch not apply to a batch size or fail, each step backend replays its own metadata
   (SGLang's per-backend decode replay, which handles a dropped table), never the precompute.
   Nothing else reads ``page_table_1`` on the default CUDA path: target verify and draft extend
   replay through the fused metadata kernels (both SGLang's and the bounded ones take no table),
   and their top-k goes to top-k v2 (``DSATopKBackend.topk_transform``'s decode-shaped PAGED
   branch: rows of the logits, the lengths and ``real_page_table`` match in both modes).
2. **One real_page_table buffer per backend** wherever the wide table stays (a reader is engaged):
   one zeroed ``[max_rows, cdiv(width, page)]`` buffer, as SGLang's drop branch allocates, sliced per
   captured batch size, instead of one tensor per batch size. The slice gets the values SGLang
   computed at capture; replays write it as before (only live columns), so past the live columns
   it holds what the last replay of any batch size left there, as in SGLang's drop branch, and as
   the wide ``page_table_1`` itself (one buffer for every batch size) always did.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_inner_fb_view
from sglang.srt.utils import is_cuda, is_hip

from sglang_dsa_mtp.integration.dsa_mtp_draft_metadata import GATES, why_not_one_launch
from sglang_dsa_mtp.integration.log import log_once
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, LIVE_WIDTH

SHARED_REAL = "_sglang_dsa_mtp_real_page_table"  # item 2: the one compact buffer, or None
STEP_READER = "_sglang_dsa_mtp_step_reader"  # on step backends: why the table stays, or None
STEPS_DROPPED = "_sglang_dsa_mtp_steps_dropped"  # on the multi-step backend: a step lacks the table
_MULTI_STEP = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"


def _role(backend) -> str:
    if backend.speculative_num_steps:
        return "draft step"
    return "speculative" if backend.speculative_num_draft_tokens else "decode"


def why_keep_wide_table(backend) -> str | None:
    """Why ``backend`` keeps its wide ``page_table_1`` whatever SGLang's own drop condition says, or
    None when SGLang's condition, with its spec-decoding clause lifted, may decide."""
    enabled, why = LIVE_WIDTH.state()
    if not enabled:
        return why
    if is_hip() or not is_cuda():
        return "not a CUDA platform"
    if not backend.speculative_num_draft_tokens:
        return "no speculative decoding: SGLang's own condition decides"
    if backend.speculative_num_steps:  # an MTP draft step backend
        return backend.__dict__.get(
            STEP_READER, "a draft step backend built outside DeepseekSparseAttnMultiStepBackend"
        )
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
        log_once(
            logging.ERROR,
            ("drop-wide-failed", type(exc).__name__, str(exc)),
            "sglang_dsa_mtp: the DSA graph state keeps SGLang's wide page_table_1: %s: %s",
            type(exc).__name__,
            exc,
        )
    finally:
        backend.speculative_num_draft_tokens = spec_tokens
    original(backend, *args, **kwargs)


def init_graph_state(original, backend, max_bs, max_num_tokens, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnBackend.init_cuda_graph_state``: items 1 and 2 above."""
    args = (max_bs, max_num_tokens, *args)
    try:
        reason = why_keep_wide_table(backend)
    except Exception as exc:  # never take the server down: SGLang decides alone
        reason = f"the gate raised {type(exc).__name__}: {exc}"
    if reason is None:
        _sglang_drop_decides(original, backend, args, kwargs)
    else:
        original(backend, *args, **kwargs)
    if backend.dsa_drop_wide_page_table:
        if reason is None:
            log_once(
                logging.INFO,
                ("drop-wide", _role(backend)),
                "sglang_dsa_mtp: %s backend: no wide page_table_1 in the CUDA graph state "
                "(nothing reads it)",
                _role(backend),
            )
        backend.__dict__[SHARED_REAL] = None
        return None
    if reason is None or not backend.speculative_num_draft_tokens:
        reason = sglang_reader(backend)
    log_once(
        logging.INFO,
        ("keep-wide", _role(backend), reason),
        "sglang_dsa_mtp: %s backend keeps its wide page_table_1: %s",
        _role(backend),
        reason,
    )
    _share_real_page_table(backend, max_num_tokens)
    return None


def _share_real_page_table(backend, max_num_tokens: int) -> None:
    backend.__dict__[SHARED_REAL] = None
    if not LIVE_WIDTH.enabled() or is_hip() or not is_cuda() or backend.physical_page_size <= 1:
        return
    page = backend.physical_page_size
    width = backend.req_to_token.shape[1]
    backend.__dict__[SHARED_REAL] = torch.zeros(
        max_num_tokens, (width + page - 1) // page, dtype=torch.int32, device=backend.device
    )


def capture_into_shared_real_table(backend, metadata, *args, **kwargs):
    """BEFORE ``_init_kpool_metadata_capture``, which SGLang calls on each captured batch size's new
    ``DSAMetadata`` before storing it: its ``real_page_table`` becomes a slice of the shared buffer,
    holding the values SGLang computed."""
    shared = backend.__dict__.get(SHARED_REAL)
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
        log_once(
            logging.ERROR,
            ("shared-real-failed", type(exc).__name__, str(exc)),
            "sglang_dsa_mtp: a captured batch size keeps its own real_page_table: %s: %s",
            type(exc).__name__,
            exc,
        )
    return None


def why_steps_keep_wide_table(multi) -> str | None:
    """Why the MTP draft step backends must keep ``page_table_1`` for SGLang's precompute + copies,
    or None when the one-launch path owns their replay."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched = getattr(HookRegistry, "_patched", set())
    for target in (f"{_MULTI_STEP}.__init__", f"{_MULTI_STEP}.init_forward_metadata_out_graph"):
        if target not in patched:
            return (
                "SGLang's draft-decode precompute + copies read it (the one-launch path, "
                f"{BOUNDED_REPLAY_METADATA.env}, is not hooked)"
            )
    reason = why_not_one_launch(multi)
    if reason is not None:
        return f"SGLang's draft-decode precompute + copies read it (no one launch: {reason})"
    return None


def steps_graph_state(original, multi, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.init_cuda_graph_state``: tell each step backend
    whether the one-launch path owns the replay, then note whether any step lost its table."""
    try:
        reason = why_steps_keep_wide_table(multi)
    except Exception as exc:  # never take the server down: the steps keep their tables
        reason = f"the gate raised {type(exc).__name__}: {exc}"
    for backend in multi.attn_backends:
        backend.__dict__[STEP_READER] = reason
    original(multi, *args, **kwargs)
    multi.__dict__[STEPS_DROPPED] = any(
        getattr(backend, "dsa_drop_wide_page_table", False) for backend in multi.attn_backends
    )


def replay_steps_without_wide_table(original, multi, forward_batch, in_capture=False):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph``: with step
    tables dropped, a batch size the one launch does not take, or whose launch fails, replays each
    step backend's own metadata (SGLang's decode replay) instead of SGLang's precompute + copies."""
    if in_capture or not multi.__dict__.get(STEPS_DROPPED, False):
        return original(multi, forward_batch, in_capture=in_capture)
    bs = forward_batch.batch_size
    if multi.__dict__.get(GATES, {}).get(bs, "undecided") is None:
        try:
            return original(multi, forward_batch, in_capture=False)
        except Exception as exc:
            log_once(
                logging.ERROR,
                ("steps-replay-failed", id(multi), bs),
                "sglang_dsa_mtp: MTP draft-decode metadata for bs %d: each step backend replays "
                "its own (the step backends have no page_table_1): %s: %s",
                bs,
                type(exc).__name__,
                exc,
            )
    else:
        log_once(
            logging.INFO,
            ("steps-replay-each", id(multi), bs),
            "sglang_dsa_mtp: MTP draft-decode metadata for bs %d: each step backend replays its "
            "own (no one launch; the step backends have no page_table_1)",
            bs,
        )
    view = build_inner_fb_view(forward_batch, bs=bs, forward_mode=ForwardMode.DECODE)
    for backend in multi.attn_backends:
        backend.init_forward_metadata_out_graph(view)
    return None


def describe() -> list[tuple[str, str, str]]:
    """(change, engages here, when or why not) for ``python -m sglang_dsa_mtp``: each part of the
    live-width switch, from what this process can know before a server starts (the switches, the
    platform, the environment); the server's own arguments decide the rest, as listed."""
    from sglang.srt.environ import envs

    blockers = []
    enabled, why = LIVE_WIDTH.state()
    if not enabled:
        blockers.append(why)
    if is_hip() or not is_cuda():
        blockers.append("not a CUDA platform")
    topk = [
        f"{name}=0"
        for name in ("SGLANG_DSA_FUSE_TOPK", "SGLANG_OPT_USE_TOPK_V2")
        if not getattr(envs, name).get()
    ]
    one_launch, one_launch_why = BOUNDED_REPLAY_METADATA.state()
    table = "page size > 1, index_kpool 1, no HiSparse, the sgl-kernel top-k backend, index top-k <= 2048"
    rows = [
        (
            "verify tree mask QLEN_ONLY, not read (DSA target)",
            blockers,
            "EAGLE topk 1 with CUDA graphs; not with --enable-watermark, --enable-two-batch-overlap",
        ),
        (
            "no wide page_table_1: target, draft extend",
            blockers + topk,
            f"speculative decoding; {table}",
        ),
        (
            "no wide page_table_1: MTP draft steps",
            blockers + topk + ([] if one_launch else [one_launch_why]),
            f"as above, and the one-launch path: --speculative-num-steps 2 to 5, {table}",
        ),
        (
            "one real_page_table per backend",
            blockers,
            "wherever a backend keeps its wide page_table_1 (a reader is engaged), page size > 1",
        ),
    ]
    return [
        (change, "no" if why_not else "yes", "; ".join(why_not) if why_not else when)
        for change, why_not, when in rows
    ]
