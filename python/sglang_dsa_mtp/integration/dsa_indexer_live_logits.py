"""Hook site: the DSA indexer's chunked paged-MQA logits (more rows than SMs).

SGLang 0.5.23's ``Indexer._get_topk_paged`` hands its closure ``_chunked_fp8_paged_mqa_logits`` to
``deepgemm_paged_mqa_logits_split``, which calls it once with every row. With more rows than
``Indexer.sm_count`` the closure computes chunks of ``sm_count`` rows and joins them with a
full-width ``torch.cat``, per top-k layer. The AROUND hook on ``deepgemm_paged_mqa_logits_split``
takes that case: the same chunks, computed by the same closure with the same chunk schedules, only
each row's live columns copied into one output
(:func:`~sglang_dsa_mtp.kernels.ops.attention.dsa_paged_mqa_logits_live.chunked_paged_mqa_logits_live`);
the top-k that follows reads only live columns, so it selects the same indices. Every condition and
argument is checked before the first chunk is computed; whatever fails sends that call, and every
later call of the same shape, to SGLang's function unchanged (logged once), as does a closure other
than SGLang's, at most ``sm_count`` rows, or the switch off. The AFTER hook on ``Indexer.__init__``
compiles the copy kernel for the model's device before any CUDA-graph capture.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.log import gate_failure, log_failure, log_once
from sglang_dsa_mtp.switches import LIVE_WIDTH

# Call shapes (rows, width, device) that failed once: SGLang's concat for good.
_FAILED: dict[tuple, str] = {}


class _Closure(NamedTuple):
    """What SGLang's chunked closure chunks with: its indexer's ``sm_count``, its ``blocksize``, and
    the resolver of the chunk-schedule function it calls (from the closure's module globals)."""

    sm_count: int
    blocksize: int
    resolve_schedule_fn: object


def sglang_closure(fn) -> Optional[_Closure]:
    """``fn``'s chunking parameters when it is SGLang 0.5.23's ``_chunked_fp8_paged_mqa_logits``,
    else None."""
    code = getattr(fn, "__code__", None)
    if getattr(fn, "__qualname__", None) != sglang_surface.CHUNKED_LOGITS_CLOSURE or code is None:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    indexer, blocksize = cells.get("self"), cells.get("blocksize")
    sm_count = getattr(indexer, "sm_count", None)
    resolve = fn.__globals__.get(sglang_surface.CHUNK_SCHEDULE_RESOLVER)
    for value in (sm_count, blocksize):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
    if not callable(resolve):
        return None
    return _Closure(sm_count, blocksize, resolve)


def _why_not_live(closure, q_fp8, ctx_lens_2d, max_seq_len, q_offset) -> Optional[str]:
    """Why a call that SGLang chunks keeps SGLang's concat, or None when the live copy applies."""
    reason = why_off(LIVE_WIDTH)
    if reason is not None:
        return reason
    if closure is None:
        return "the logits function is not SGLang 0.5.23's _chunked_fp8_paged_mqa_logits closure"
    if q_fp8.dim() != 3:
        return f"q_fp8 is {q_fp8.dim()}-D, SGLang's split path passes [rows, heads, dim]"
    if ctx_lens_2d.dtype != torch.int32 or tuple(ctx_lens_2d.shape[1:]) != (1,):
        return f"context lengths are {ctx_lens_2d.dtype} {tuple(ctx_lens_2d.shape)}, not int32 [rows, 1]"
    if ctx_lens_2d.shape[0] < q_offset:
        return f"{ctx_lens_2d.shape[0]} context lengths for {q_offset} rows"
    if max_seq_len % live.ALIGN:
        return f"the logits width {max_seq_len} is not a multiple of {live.ALIGN}"
    if not live.is_warm(q_fp8.device):
        return f"the live-copy kernel was not compiled for {q_fp8.device} at start-up"
    return None


def live_width_split(original, *args, **kwargs):
    """AROUND ``deepgemm_paged_mqa_logits_split``: chunked calls copy live columns, not full rows."""
    logits = _live_logits(*args, **kwargs)
    return original(*args, **kwargs) if logits is None else logits


def _live_logits(
    fp8_paged_mqa_logits_fn,
    q_fp8,
    kv_cache_fp8,
    weights,
    ctx_lens_2d,
    block_tables,
    schedule_metadata,
    max_seq_len,
    *,
    q_offset,
) -> Optional[torch.Tensor]:
    """The split function's result through the live copy, or None where SGLang's path runs."""
    shape = (q_offset, max_seq_len, str(getattr(q_fp8, "device", None)))
    if shape in _FAILED:
        return None  # SGLang's path for good, said once at ERROR when this shape failed
    try:
        closure = sglang_closure(fp8_paged_mqa_logits_fn)
        if closure is not None and q_offset <= closure.sm_count:
            return None  # one logits call, no concat to remove
        reason = _why_not_live(closure, q_fp8, ctx_lens_2d, max_seq_len, q_offset)
    except Exception as exc:  # never take the server down: SGLang's path stays
        reason = gate_failure(exc, "chunked indexer logits keep SGLang's full-width concat")
    if reason is not None:
        log_once(
            logging.INFO,
            ("live-logits-off", reason),
            "sglang_dsa_mtp: chunked indexer logits keep SGLang's full-width concat: %s",
            reason,
        )
        return None

    def whole_copy(why: str) -> None:  # this call stays right; later calls of the shape: SGLang's
        _FAILED[shape] = why
        log_once(
            logging.WARNING,
            ("live-logits-whole-copy", why),
            "sglang_dsa_mtp: a chunk of indexer logits was copied whole (%s); calls of %d rows "
            "x %d columns keep SGLang's concat from now on",
            why,
            q_offset,
            max_seq_len,
        )

    try:
        logits = live.chunked_paged_mqa_logits_live(
            fp8_paged_mqa_logits_fn,
            lambda lens, block_kv, num_sms: closure.resolve_schedule_fn()(lens, block_kv, num_sms),
            q_fp8.unsqueeze(1)[:q_offset],
            kv_cache_fp8,
            weights[:q_offset],
            ctx_lens_2d,
            block_tables,
            max_seq_len,
            chunk_rows=closure.sm_count,
            block_kv=closure.blocksize,
            on_whole_copy=whole_copy,
        )
    except Exception as exc:  # SGLang's concat takes this call and every later one of its shape
        _FAILED[shape] = f"{type(exc).__name__}: {exc}"
        log_failure(
            ("live-logits-error", type(exc).__name__, str(exc)),
            exc,
            "sglang_dsa_mtp: the live-column indexer logits of %d rows x %d columns raised; "
            "SGLang's concat takes calls of that shape",
            q_offset,
            max_seq_len,
        )
        return None
    log_once(
        logging.INFO,
        ("live-logits-on",),
        "sglang_dsa_mtp: chunked indexer logits copy live columns only (%d rows, chunks of %d)",
        q_offset,
        closure.sm_count,
    )
    return logits


def weights_device(module: torch.nn.Module) -> torch.device:
    """The device ``module``'s weights were built on (SGLang builds a model on its GPU)."""
    for tensor in module.parameters():
        return tensor.device
    return torch.get_default_device()


def warm_up_live_logits(result, indexer, *args, **kwargs):
    """AFTER ``Indexer.__init__``: compile the live-copy kernel for the indexer's CUDA device, once
    per device (Triton's interpreter, on the CPU, compiles nothing)."""
    try:
        device = weights_device(indexer)
        if why_off(LIVE_WIDTH) is None and device.type == "cuda" and not live.is_warm(device):
            live.warm_up(device)
    except Exception as exc:  # chunked calls then keep SGLang's concat (is_warm stays False)
        log_failure(
            ("live-logits-warm-up", type(exc).__name__, str(exc)),
            exc,
            "sglang_dsa_mtp: compiling the live-copy kernel raised; chunked indexer logits keep "
            "SGLang's concat",
        )
    return result
