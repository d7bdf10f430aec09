"""Hook site: the MTP draft-decode replay of ``DeepseekSparseAttnMultiStepBackend``.

SGLang 0.5.23 replays each draft round by precomputing decode metadata into a full-width scratch table
(``_precompute_replay_metadata``) and copying the whole width into every draft step backend's graph
buffers. Here, for a captured bs whose step backends' tables match, one bounded launch
(``fused_dsa_draft_decode_metadata_multi``) writes every step backend's buffers straight from
``req_to_token``; each step backend then does the per-step work that stays:

- ``set_dsa_prefill_impl(None)`` and ``forward_metadata = metadata``, as the stock copies do;
- FlashMLA tile metadata (``flashmla_kv`` decode), computed once and copied into every step, as stock;
- the DeepGEMM paged-MQA schedule, the top-k v2 plan and the 2-D context lengths, fresh for EVERY
  step backend when the draft's top-k is not seeded from draft extend (stock leaves steps 0-2
  un-refreshed when it has 3 or more step backends): computed once, by SGLang's own refresh on step
  0, and copied into the other steps (their inputs are identical); for none when it is seeded:
  seeded steps never run the indexer, the only reader of the three.

Two hooks: AROUND ``__init__`` keeps the ``seed_dsa_topk_from_draft_extend`` flag (SGLang does not
store it), and AROUND ``init_forward_metadata_out_graph`` decides the gate per captured bs at capture
(one INFO line per multi-step backend, one more per bs that decides otherwise), compiles the one
launch's kernel variant for that bs there (on twin buffers, outside stream capture), and takes the
one-launch path on replay.
"""

from __future__ import annotations

import inspect
import logging

import torch
from sglang.srt.layers.attention.dsa_backend import _to_2d_context_lens
from sglang.srt.utils import is_cuda, is_hip

from sglang_dsa_mtp.integration.log import log_once, logger
from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import (
    MAX_DESTINATIONS,
    DecodeMetadataDestination,
    fused_dsa_draft_decode_metadata_multi,
)
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded import warm_up
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA

SEEDED = "_sglang_dsa_mtp_seeded"  # the constructor's seed_dsa_topk_from_draft_extend
GATES = "_sglang_dsa_mtp_one_launch"  # {bs: None when one launch applies, else the reason}


def keep_seed_flag(original, self, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.__init__``: remember whether steps are seeded."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    original(self, *args, **kwargs)
    setattr(self, SEEDED, bool(bound.arguments["seed_dsa_topk_from_draft_extend"]))


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
    enabled, why = BOUNDED_REPLAY_METADATA.state()
    if not enabled:
        return why
    if is_hip():
        return "HIP: the one-launch path is CUDA-only"
    if not is_cuda():
        return "not a CUDA platform"
    if not hasattr(multi, SEEDED):
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


def _decide(multi, bs: int) -> str | None:
    gates = multi.__dict__.setdefault(GATES, {})
    if bs not in gates:
        gates[bs] = why_not_one_launch(multi, bs)
        _report(multi, bs, gates)
    return gates[bs]


def _report(multi, bs: int, gates: dict) -> None:
    """The multi-step backend's start-up line at its first decided bs; a line per later bs that
    decides otherwise."""
    reason = gates[bs]
    outcome = (
        "uses one launch" if reason is None else f"keeps SGLang's precompute + copies: {reason}"
    )
    if len(gates) > 1:
        first = next(iter(gates.values()))
        if (reason is None) != (first is None):
            logger.info("sglang_dsa_mtp: MTP draft-decode metadata for bs %d %s", bs, outcome)
        return
    logger.info(
        "sglang_dsa_mtp: one-launch MTP draft-decode metadata %s for the MTP draft-decode "
        "backend (%s); first captured bs %d %s",
        "on" if reason is None else "off",
        _facts(multi),
        bs,
        outcome,
    )


def _facts(multi) -> str:
    """What decides the one-launch path and what it does per step, for the log."""
    backends = getattr(multi, "attn_backends", [])
    facts = [f"{len(backends)} step backends"]
    if hasattr(multi, SEEDED):
        facts.append(
            "seeded steps: indexer plans not refreshed"
            if getattr(multi, SEEDED)
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


def one_launch_out_graph(original, self, forward_batch, in_capture=False):
    """AROUND ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph``."""
    bs = forward_batch.batch_size
    if in_capture:
        result = original(self, forward_batch, in_capture=True)
        if _decide(self, bs) is None:
            _warm_up_one_launch(self, forward_batch, bs)
        return result
    if _decide(self, bs) is not None:
        return original(self, forward_batch, in_capture=False)
    try:
        write_draft_decode_metadata(self, forward_batch, bs)
    except Exception as exc:  # never take the server down: SGLang's path rewrites every buffer
        _fall_back(self, bs, f"the one launch raised {type(exc).__name__}: {exc}")
        return original(self, forward_batch, in_capture=False)
    return None


def _fall_back(multi, bs: int, reason: str) -> None:
    """``bs`` takes SGLang's precompute + copies for good; logged once at ERROR."""
    getattr(multi, GATES)[bs] = reason
    log_once(
        logging.ERROR,
        ("one-launch-failed", id(multi), bs),
        "sglang_dsa_mtp: MTP draft-decode metadata for bs %d falls back to SGLang's path: %s",
        bs,
        reason,
    )


def _warm_up_one_launch(multi, forward_batch, bs: int) -> None:
    """Compile the one launch's kernel variant for ``bs`` on twin buffers, outside stream capture
    (inside one: skipped, its first replay compiles); a warm-up that raises sends ``bs`` to
    SGLang's path, as the replay would."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(
            logging.WARNING,
            ("one-launch-warm-up-in-capture", id(multi)),
            "sglang_dsa_mtp: MTP draft-decode metadata captured inside a stream capture: not warmed "
            "up, its first replay compiles",
        )
        return
    try:
        warm_up(
            fused_dsa_draft_decode_metadata_multi, **one_launch_kwargs(multi, forward_batch, bs)
        )
    except Exception as exc:
        _fall_back(multi, bs, f"its warm-up raised {type(exc).__name__}: {exc}")


def one_launch_kwargs(multi, forward_batch, bs: int) -> dict:
    """The one launch's keyword arguments for a replay of ``bs``."""
    backends = multi.attn_backends
    metas = [backend.decode_cuda_graph_metadata[bs] for backend in backends]
    first, m0 = backends[0], metas[0]
    page_size = first.physical_page_size
    return dict(
        seq_lens=forward_batch.seq_lens,
        req_pool_indices=forward_batch.req_pool_indices,
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
        max_len=first._graph_page_table_width(m0),
        dsa_index_topk=first.dsa_index_topk,
        physical_page_size=page_size,
    )


def write_draft_decode_metadata(multi, forward_batch, bs: int) -> None:
    """The one-launch replay: every step backend's metadata for ``bs``, then its per-step work."""
    backends = multi.attn_backends
    metas = [backend.decode_cuda_graph_metadata[bs] for backend in backends]
    first, m0 = backends[0], metas[0]
    for backend in backends:
        backend.set_dsa_prefill_impl(forward_batch=None)
    fused_dsa_draft_decode_metadata_multi(**one_launch_kwargs(multi, forward_batch, bs))
    if first.dsa_decode_impl == "flashmla_kv":
        flashmla = first._compute_flashmla_metadata(
            cache_seqlens=m0.dsa_cache_seqlens_int32[:bs], seq_len_q=1
        )
        for m in metas:
            m.flashmla_metadata.slice(slice(0, bs + 1)).copy_(flashmla)
    if not getattr(multi, SEEDED):
        refresh_indexer_plans_once(backends, metas, bs)
    for backend, m in zip(backends, metas):
        backend.forward_metadata = m


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
            object.__setattr__(dst, name, _to_2d_context_lens(dst.cache_seqlens_int32, bs))
            continue
        if want is None or have is None or want.shape != have.shape or want.dtype != have.dtype:
            return None
        pairs.append((have, want))
    return pairs


def _refresh_indexer_plans(backend, metadata, bs: int) -> None:
    """What SGLang's replay refreshes for the indexer of a decode step, from the new lengths."""
    ctx_lens = _to_2d_context_lens(metadata.cache_seqlens_int32, bs)
    backend._refresh_paged_mqa_schedule_metadata(metadata, ctx_lens)
    backend._refresh_topk_v2_plan(metadata)
    if metadata.paged_mqa_ctx_lens_2d is None:
        object.__setattr__(metadata, "paged_mqa_ctx_lens_2d", ctx_lens)
    else:
        metadata.paged_mqa_ctx_lens_2d.copy_(ctx_lens)
