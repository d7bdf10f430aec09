"""Hook site: the MTP draft-decode replay of ``DeepseekSparseAttnMultiStepBackend``.

Instead of SGLang 0.5.23's precompute into a full-width scratch table and copies into every draft
step backend, each captured bs replays, as decided at its capture:

1. **one launch** (bounded replay metadata on, step tables matching): every step's buffers from
   ``req_to_token``, then the per-step work; unseeded steps' indexer plans refreshed once, copied;
2. **each step backend's own replay**, where the live-width hooks dropped their wide tables;
3. **SGLang's precompute + copies** otherwise.

A one launch that raises, or deciding a bs's path at its capture, sends that bs to 2 or 3 for good
(one ERROR line). Neither compiles then:
each step backend's kernels (ours and SGLang's behind it, which 2 and 3 call) are warmed up at their
own capture (``dsa_metadata_capture``), and SGLang's JIT metadata copies, which only 3 runs, are
loaded when a bs is captured for the one launch with the step tables kept. Hooks: AROUND
``__init__`` (keeps ``seed_dsa_topk_from_draft_extend``), AROUND ``init_forward_metadata_out_graph``
(both switches, and the metadata glue's: each replay's prep, whichever path, through the glue of
``dsa_metadata_glue`` where it applies). Details: docs/switches.md, section "One-launch MTP
draft-decode metadata".
"""

from __future__ import annotations

import inspect
import logging

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_inner_fb_view

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.dsa_metadata_glue import capture_mtp, mtp_replay
from sglang_dsa_mtp.integration.fallback import log_launcher
from sglang_dsa_mtp.integration.state import DraftDecodeBs, MultiStepState, peek, state_of
from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import (
    MAX_DESTINATIONS,
    ONE_LAUNCH_BINDER,
    DecodeMetadataDestination,
    fused_dsa_draft_decode_metadata_multi,
)
from sglang_dsa_mtp.kernels.ops.launch import warm_up
from sglang_dsa_mtp.log import log_failure, log_once, logger
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA


def keep_seed_flag(original, self, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.__init__``: remember whether steps are seeded."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    original(self, *args, **kwargs)
    state = state_of(self, MultiStepState)
    state.seeded = bool(bound.arguments["seed_dsa_topk_from_draft_extend"])


def _tables_mismatch(metas, backends) -> str | None:
    first, m0 = backends[0], metas[0]
    for i, (backend, m) in enumerate(zip(backends, metas)):
        if backend.req_to_token is not first.req_to_token:
            return f"step backend {i} reads another req_to_token than step 0"
        for attr in ("physical_page_size", "dsa_index_topk", "dsa_decode_impl"):
            if getattr(backend, attr) != getattr(first, attr):
                return f"step backend {i} has another {attr} than step 0"
        for name in ("page_table_1", "real_page_table"):
            a, b = getattr(m, name), getattr(m0, name)
            if (a is None) != (b is None):
                return f"step backend {i} {'lacks' if a is None else 'has'} {name}, step 0 not"
            if a is not None and (
                a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype
            ):
                return f"step backend {i}'s {name} is {tuple(a.shape)}, step 0's {tuple(b.shape)}"
    if m0.page_table_1 is None:
        if first.physical_page_size == 1:
            return "the step backends have no page_table_1 (page size 1)"
    elif m0.page_table_1.dtype != torch.int32:
        return f"page_table_1 is {m0.page_table_1.dtype}, not int32"
    return None


def why_not_one_launch(multi, bs: int | None = None) -> str | None:
    """Why the captured ``bs`` must keep SGLang's precompute + copies, or None when one launch applies.

    With ``bs`` None, only the conditions known before any capture (no per-bs graph metadata)."""
    reason = why_off(BOUNDED_REPLAY_METADATA)
    if reason is not None:
        return reason
    if peek(multi, MultiStepState).seeded is None:
        return "the backend was built before the plugin's hooks applied (seed flag unknown)"
    backends = multi.attn_backends
    if not 1 <= len(backends) <= MAX_DESTINATIONS:
        return f"{len(backends)} step backends; one launch writes at most {MAX_DESTINATIONS}"
    for i, backend in enumerate(backends):
        if backend.dsa_index_kpool != 1:
            return f"step backend {i} has dsa_index_kpool {backend.dsa_index_kpool}"
        if backend.experimental_kpool_metadata_fusion:
            return f"step backend {i} uses KPool metadata fusion"
        if bs is not None and bs not in backend.decode_cuda_graph_metadata:
            return f"step backend {i} has no CUDA-graph metadata for bs {bs}"
    if bs is None:
        return None
    return _tables_mismatch([b.decode_cuda_graph_metadata[bs] for b in backends], backends)


def draft_decode_metadata(original, self, forward_batch, in_capture=False):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph``."""
    if in_capture:
        result = original(self, forward_batch, in_capture=True)
        _capture(self, forward_batch)
        capture_mtp(self, forward_batch, lambda fb: _replay(original, self, fb))
        return result
    if mtp_replay(self, forward_batch):
        return None
    return _replay(original, self, forward_batch)


def _replay(original, self, forward_batch) -> None:
    """One replay's prep, eagerly: the one launch, each step's own replay, or SGLang's."""
    state = peek(self, MultiStepState)
    bs = forward_batch.batch_size
    plan = state.batch_sizes.get(bs)
    if plan is not None and plan.reason is None:
        try:
            write_draft_decode_metadata(self, forward_batch, plan)
            return None
        except Exception as exc:  # never take the server down: rewrite every buffer another way
            _give_up(self, state, plan, bs, exc, "the one launch")
    if state.steps_dropped:
        _replay_each_step(self, forward_batch, bs)
        return None
    original(self, forward_batch, in_capture=False)
    return None


def _give_up(multi, state: MultiStepState, plan: DraftDecodeBs, bs: int, exc, what: str) -> None:
    """``bs`` takes the other path for good (:func:`_other_path`); one ERROR line says which.
    ``what`` names the step that raised: "deciding its path", "its warm-up", "the one launch"."""
    plan.reason, plan.failed = f"{what} raised {type(exc).__name__}: {exc}", True
    log_failure(
        ("one-launch-failed", id(multi), bs),
        exc,
        "sglang_dsa_mtp: MTP draft-decode metadata for bs %d %s from now on: %s raised",
        bs,
        _other_path(state),
        what,
    )


def _other_path(state: MultiStepState) -> str:
    """What a batch size the one launch does not write takes instead, in words."""
    if state.steps_dropped:
        return "replays each step backend's own metadata (the step backends have no page_table_1)"
    return "keeps SGLang's precompute + copies"


def _capture(multi, forward_batch) -> None:
    """At the capture of a bs: decide its path and the one launch's arguments, compile its variant
    and bind its launch (outside stream capture); say what was decided."""
    bs = forward_batch.batch_size
    state = state_of(multi, MultiStepState)
    try:
        plan = DraftDecodeBs(why_not_one_launch(multi, bs))
        if plan.reason is None:
            plan.metadata = [
                backend.decode_cuda_graph_metadata[bs] for backend in multi.attn_backends
            ]
            plan.launch = one_launch_kwargs(multi, plan.metadata, bs)
    except Exception as exc:  # never take the capture down: another path writes this bs
        plan = DraftDecodeBs(None)
        _give_up(multi, state, plan, bs, exc, "deciding its path")
    state.batch_sizes[bs] = plan
    _report(multi, state, bs)
    if plan.reason is None:
        _warm_up_one_launch(multi, state, forward_batch, plan, bs)
        if not state.steps_dropped:
            load_precompute_copies(multi)


def _report(multi, state: MultiStepState, bs: int) -> None:
    """The multi-step backend's start-up line at its first captured bs; a line per later capture
    that decides otherwise than that line said. A failure is named by its own ERROR line only."""
    plan = state.batch_sizes[bs]
    reason = plan.reason
    if reason is None:
        outcome = "uses one launch"
    elif plan.failed:
        outcome = f"{_other_path(state)} (its failure logged at ERROR)"
    else:
        outcome = f"{_other_path(state)}: {reason}"
    if state.one_launch_logged is not None:
        if (reason is None) != state.one_launch_logged:
            logger.info("sglang_dsa_mtp: MTP draft-decode metadata for bs %d %s", bs, outcome)
        return
    state.one_launch_logged = reason is None
    logger.info(
        "sglang_dsa_mtp: one-launch MTP draft-decode metadata %s for the MTP draft-decode "
        "backend (%s); first captured bs %d %s",
        "on" if reason is None else "off",
        _facts(multi, state),
        bs,
        outcome,
    )


def _facts(multi, state: MultiStepState) -> str:
    """What decides the one-launch path and what it does per step, for the log."""
    backends = getattr(multi, "attn_backends", [])
    facts = [f"{len(backends)} step backends"]
    if state.seeded is not None:
        facts.append(
            "seeded steps: indexer plans not refreshed"
            if state.seeded
            else "unseeded steps: indexer plans refreshed once per round, copied to every step"
        )
    if backends:
        first = backends[0]
        facts += [
            f"index_kpool {getattr(first, 'dsa_index_kpool', '?')}",
            "KPool fusion "
            + ("on" if getattr(first, "experimental_kpool_metadata_fusion", False) else "off"),
            f"decode impl {getattr(first, 'dsa_decode_impl', '?')}",
        ]
    return ", ".join(facts)


def _warm_up_one_launch(multi, state, forward_batch, plan: DraftDecodeBs, bs: int) -> None:
    """Compile the one launch's kernel variant for ``bs`` on twin buffers and bind its launch
    (``launch.Binder.bind``), outside stream capture (inside one: skipped, its replays go through
    the wrapper, the first compiling); a warm-up that raises sends ``bs`` to another path, as the
    replay would."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(
            logging.WARNING,
            ("one-launch-warm-up-in-capture", id(multi)),
            "sglang_dsa_mtp: MTP draft-decode metadata captured inside a stream capture: not warmed "
            "up, its first replay compiles",
        )
        return
    kwargs = one_launch_call(plan, forward_batch)
    try:
        warm_up(fused_dsa_draft_decode_metadata_multi, **kwargs)
        plan.bound, why = ONE_LAUNCH_BINDER.bind(**kwargs)
        log_launcher(ONE_LAUNCH_BINDER.what, why)
    except Exception as exc:
        _give_up(multi, state, plan, bs, exc, "its warm-up")


def load_precompute_copies(multi) -> None:
    """Load SGLang's JIT metadata-copy modules that its precompute + copies run at a replay (the
    other path of a bs whose one launch raises, the step tables kept): nothing else loads them
    before such a replay, and a module's first load compiles it. As SGLang 0.5.23's
    ``init_forward_metadata_out_graph`` and ``_copy_base_replay_buffers`` request them (decode, the
    same cache keys): the three-step copy with more than 3 speculative steps, and the one-step copy
    (the other steps, and every step should the three-step copy fail). One that fails to load is
    logged once; SGLang's path then copies with torch."""
    first = multi.attn_backends[0]
    has_real_page_table = first.physical_page_size > 1
    has_flashmla = first.dsa_decode_impl == "flashmla_kv"
    try:
        sglang_surface.load_metadata_copies(
            multi.speculative_num_steps > 3, has_real_page_table, has_flashmla
        )
    except Exception as exc:
        log_once(
            logging.WARNING,
            ("precompute-copies-load", id(multi)),
            "sglang_dsa_mtp: SGLang's JIT metadata copies did not load (%s: %s): a bs whose one "
            "launch fails takes SGLang's precompute + copies with torch copies",
            type(exc).__name__,
            exc,
        )


def one_launch_kwargs(multi, metas, bs: int) -> dict:
    """The one launch's keyword arguments for the replays of ``bs``, but ``seq_lens`` and
    ``req_pool_indices`` (each replay's inputs)."""
    first, m0 = multi.attn_backends[0], metas[0]
    page_size = first.physical_page_size
    return dict(
        req_to_token=first.req_to_token,
        destinations=[
            DecodeMetadataDestination(
                cache_seqlens=m.cache_seqlens_int32,
                cu_seqlens_k=m.cu_seqlens_k,
                page_table_1=m.page_table_1,
                dsa_cache_seqlens=m.dsa_cache_seqlens_int32,
                dsa_cu_seqlens_k=m.dsa_cu_seqlens_k,
                real_page_table=m.real_page_table if page_size > 1 else None,
            )
            for m in metas
        ],
        bs=bs,
        max_len=sglang_surface.graph_page_table_width(first, m0),
        dsa_index_topk=first.dsa_index_topk,
        physical_page_size=page_size,
    )


def one_launch_call(plan: DraftDecodeBs, forward_batch) -> dict:
    """The one launch's keyword arguments for ``forward_batch``: the plan's, with its inputs."""
    return dict(
        plan.launch,
        seq_lens=forward_batch.seq_lens,
        req_pool_indices=forward_batch.req_pool_indices,
    )


def write_draft_decode_metadata(multi, forward_batch, plan: DraftDecodeBs) -> None:
    """The one-launch replay: every step backend's metadata for the batch, then its per-step work."""
    backends, metas = multi.attn_backends, plan.metadata
    bs = plan.launch["bs"]
    first, m0 = backends[0], metas[0]
    for backend in backends:
        backend.set_dsa_prefill_impl(forward_batch=None)
    kwargs = one_launch_call(plan, forward_batch)
    if plan.bound is None or not plan.bound(kwargs):
        fused_dsa_draft_decode_metadata_multi(**kwargs)
    if first.dsa_decode_impl == "flashmla_kv":
        flashmla = sglang_surface.flashmla_metadata(first, m0.dsa_cache_seqlens_int32[:bs], 1)
        for m in metas:
            m.flashmla_metadata.slice(slice(0, bs + 1)).copy_(flashmla)
    if not peek(multi, MultiStepState).seeded:
        refresh_indexer_plans_once(backends, metas, bs)
    for backend, m in zip(backends, metas):
        backend.forward_metadata = m


def _replay_each_step(multi, forward_batch, bs: int) -> None:
    """Each step backend replays its own decode metadata (SGLang's per-backend replay, which needs
    no wide table), instead of SGLang's precompute + copies, which would read the dropped tables."""
    view = build_inner_fb_view(forward_batch, bs=bs, forward_mode=ForwardMode.DECODE)
    for backend in multi.attn_backends:
        backend.init_forward_metadata_out_graph(view)


# The indexer's per-step plans: each is recomputed from the step's lengths (identical in every step
# after the one launch) and copied into the step's captured buffer.
_PLANS = ("paged_mqa_schedule_metadata", "topk_v2_plan", "paged_mqa_ctx_lens_2d")


def refresh_indexer_plans_once(backends, metas, bs: int) -> None:
    """What SGLang's per-step replay refreshes for each step's indexer, computed once: SGLang's own
    refresh on step 0, then one batched copy of step 0's plans into every other step (a step whose
    buffers differ from step 0's in shape or dtype gets SGLang's own refresh instead)."""
    _refresh_indexer_plans(backends[0], metas[0], bs)
    dsts, srcs = [], []
    for backend, m in zip(backends[1:], metas[1:]):
        pairs = _plan_copies(metas[0], m, bs)
        if pairs is None:
            _refresh_indexer_plans(backend, m, bs)
        else:
            dsts += [dst for dst, _ in pairs]
            srcs += [src for _, src in pairs]
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _plan_copies(src, dst, bs: int):
    """(destination, source) pairs that give ``dst`` what SGLang's refresh would, or None when a
    buffer does not match ``src``'s (``dst`` is then refreshed on its own)."""
    pairs = []
    for name in _PLANS:
        want, have = getattr(src, name), getattr(dst, name)
        if want is None and have is None:
            continue
        if have is None and name == "paged_mqa_ctx_lens_2d":
            # SGLang's refresh stores a (bs, 1) view of the step's own lengths here.
            ctx_lens = sglang_surface.to_2d_context_lens(dst.cache_seqlens_int32, bs)
            object.__setattr__(dst, name, ctx_lens)
            continue
        if want is None or have is None or want.shape != have.shape or want.dtype != have.dtype:
            return None
        pairs.append((have, want))
    return pairs


def _refresh_indexer_plans(backend, metadata, bs: int) -> None:
    """What SGLang's replay refreshes for the indexer of a decode step, from the new lengths."""
    ctx_lens = sglang_surface.to_2d_context_lens(metadata.cache_seqlens_int32, bs)
    sglang_surface.refresh_indexer_plans(backend, metadata, ctx_lens)
    if metadata.paged_mqa_ctx_lens_2d is None:
        object.__setattr__(metadata, "paged_mqa_ctx_lens_2d", ctx_lens)
    else:
        metadata.paged_mqa_ctx_lens_2d.copy_(ctx_lens)
