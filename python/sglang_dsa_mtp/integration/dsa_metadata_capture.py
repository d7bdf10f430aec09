"""Hook site: a DSA backend builds the CUDA-graph metadata of a batch size (at capture).

SGLang 0.5.23's ``DeepseekSparseAttnBackend._apply_cuda_graph_metadata`` builds the metadata of a
batch size the first time it sees it (``_build_forward_metadata_cuda_graph``, from the graph runner's
``init_forward_metadata_out_graph(..., in_capture=True)``, outside stream capture) and launches the
replay-metadata kernel only at later calls: the first replay of each captured batch size, serving a
request, would compile our kernel's variant, and the first replay that falls back to SGLang's kernel
SGLang's variant. This AFTER hook, for a backend that uses the bounded kernels
(``dsa_metadata_selection``), warms both variants up right away (``Fallback.warm_up``): the call
SGLang's replay will make for this batch size and mode, made on twin buffers (``launch.warm_up``),
never on the captured ones; then ours's launch of that call is bound for the replays
(``launch.Binder.bind``). A warm-up inside a stream capture is skipped (logged; the first replay
then compiles); one of ours that raises sends that batch size to SGLang's kernel (``fallback``:
logged once at ERROR), as the replay would have; one of SGLang's that raises is logged once. Any
other error once the backend's kernel is known (building the replay's arguments, say) also sends
that batch size to SGLang's kernel, logged the same way: ours would otherwise first compile on a
live request, where SGLang's kernel runs as stock SGLang runs it.

The first time a backend builds graph metadata, one INFO line says whether it uses the bounded kernels
and what decided it.
"""

from __future__ import annotations

import inspect
import logging

import torch
from sglang.srt.runtime_context import get_platform

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.integration.dsa_metadata_selection import selected_kernel
from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.integration.state import BackendState, state_of
from sglang_dsa_mtp.log import log_failure, log_once, logger

_BUILD = inspect.signature(sglang_surface.resolve(sglang_surface.BUILD_FORWARD_METADATA_CUDA_GRAPH))


def warm_up_captured_bs(result, *args, **kwargs):
    """AFTER ``DeepseekSparseAttnBackend._build_forward_metadata_cuda_graph``."""
    kernel = bs = None
    try:
        call = _BUILD.bind(*args, **kwargs)
        backend, bs, mode = (
            call.arguments["self"],
            call.arguments["bs"],
            call.arguments["forward_mode"],
        )
        op, kernel = replay_kernel(backend, mode)
        _report_once(backend, mode)
        if kernel is None:
            return result
        kwargs = replay_kwargs(
            backend, bs, mode, call.arguments["seq_lens"], call.arguments["req_pool_indices"]
        )
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            log_once(
                logging.WARNING,
                ("warm-up-in-capture", op),
                "sglang_dsa_mtp: DSA %s replay metadata built inside a stream capture: not warmed "
                "up, its first replay compiles",
                op,
            )
            return result
        kernel.warm_up(**kwargs)
    except Exception as exc:  # never take the capture down: SGLang's kernel takes this bs
        if kernel is not None:
            kernel.fall_back(bs, exc)
        else:
            log_failure(
                ("warm-up-failed", type(exc).__name__, str(exc)),
                exc,
                "sglang_dsa_mtp: warming up the DSA replay metadata failed",
            )
    return result


def role(backend, mode) -> str:
    """Which backend this is, from the mode it captures: target, draft extend or an MTP draft step."""
    if mode.is_target_verify():
        return "target-verify backend"
    if mode.is_draft_extend_v2():
        return "draft-extend backend"
    if getattr(backend, "speculative_num_steps", 0):
        return f"MTP draft step {backend.speculative_step_id} backend"
    return "decode backend"


def _report_once(backend, mode) -> None:
    state = state_of(backend, BackendState)
    if state.reported:
        return
    state.reported = True
    reason = state.bounded_reason
    facts = (
        f"index_kpool {backend.dsa_index_kpool}, KPool fusion "
        f"{'on' if backend.experimental_kpool_metadata_fusion else 'off'}"
    )
    if reason is None:
        logger.info(
            "sglang_dsa_mtp: bounded_replay_metadata on for the %s: bounded kernels (%s)",
            role(backend, mode),
            facts,
        )
    else:
        logger.info(
            "sglang_dsa_mtp: bounded_replay_metadata off for the %s, SGLang's kernels: %s (%s)",
            role(backend, mode),
            reason,
            facts,
        )


# The backend attribute SGLang 0.5.23's replay calls in each mode, and the operation's name.
_DECODE = ("decode", "_fused_decode_metadata")
_VERIFY = ("target verify", "_fused_verify_metadata")
_DRAFT_EXTEND = ("draft extend", "_fused_draft_extend_metadata")


def replay_kernel(backend, mode) -> tuple[str, Fallback | None]:
    """(op, the :class:`Fallback` of the backend's kernel attribute) that SGLang 0.5.23's
    ``_apply_cuda_graph_metadata`` calls at a replay in ``mode``, or (op, None) when the backend
    does not run our kernel for it (the attribute then is SGLang's kernel)."""
    if mode.is_decode_or_idle():
        op, attr = _DECODE
    elif mode.is_target_verify():
        op, attr = _VERIFY
    elif mode.is_draft_extend_v2():
        op, attr = _DRAFT_EXTEND
    else:
        return str(mode), None
    return op, selected_kernel(backend, attr)


def replay_kwargs(backend, bs: int, mode, seq_lens, req_pool_indices) -> dict:
    """The keyword arguments of the call ``_apply_cuda_graph_metadata`` makes at a replay of ``bs``
    in ``mode`` (one :func:`replay_kernel` runs ours for). ``seq_lens`` / ``req_pool_indices``: the
    graph runner's input buffers (the capture batch's)."""
    metadata = backend.decode_cuda_graph_metadata[bs]
    width = sglang_surface.graph_page_table_width(backend, metadata)
    common = dict(
        seq_lens=seq_lens[:bs],
        req_pool_indices=req_pool_indices[:bs],
        req_to_token=backend.req_to_token,
        cache_seqlens=metadata.cache_seqlens_int32,
        cu_seqlens_k=metadata.cu_seqlens_k,
        page_table_1=metadata.page_table_1,
        dsa_cache_seqlens=metadata.dsa_cache_seqlens_int32,
        dsa_cu_seqlens_k=metadata.dsa_cu_seqlens_k,
        real_page_table=metadata.real_page_table,
        bs=bs,
        dsa_index_topk=backend.dsa_index_topk,
        physical_page_size=backend.physical_page_size,
    )
    next_n = backend.speculative_num_draft_tokens
    if mode.is_decode_or_idle():
        return dict(common, max_len=width)
    if mode.is_target_verify():
        ctx_lens = metadata.paged_mqa_ctx_lens_2d
        sm100_2d = (
            next_n >= 2
            and get_platform().is_sm100
            and ctx_lens is not None
            and ctx_lens.dim() == 2
            and tuple(ctx_lens.shape) == (bs, next_n)
        )
        return dict(
            common,
            seqlens_expanded=metadata.dsa_seqlens_expanded,
            max_seqlen_k=width,
            next_n=next_n,
            paged_mqa_ctx_lens_2d=ctx_lens if sm100_2d else None,
        )
    return dict(
        common,
        extend_seq_lens=torch.full((bs,), next_n, dtype=torch.int32, device=backend.device),
        seqlens_expanded=metadata.dsa_seqlens_expanded,
        total_len=next_n * bs,
        max_seqlen_k=width,
        max_extend_len=next_n,
        max_total_len=bs * next_n,
        static_extend_len=True,
    )
