"""Hook site: the DSA indexer's chunked paged-MQA logits (more rows than SMs).

SGLang 0.5.23's ``Indexer._get_topk_paged`` builds a closure ``_chunked_fp8_paged_mqa_logits`` and
hands it to ``deepgemm_paged_mqa_logits_split`` (``sglang/kernels/ops/attention/dsa/paged_mqa_logits.py``),
which calls it once with every row (``q_offset`` rows: requests x draft tokens in target verify on
SM90 and in draft extend, requests in decode). With more rows than ``Indexer.sm_count`` the closure
computes chunks of ``sm_count`` rows and ``torch.cat``s them: a full-width copy of ``rows x max_len``
fp32 logits, per top-k layer.

The AROUND hook on ``deepgemm_paged_mqa_logits_split`` (SGLang's ``HookRegistry`` rebinds the
indexer module's ``from ... import`` of it) takes that case: the same chunks, computed by the same
closure with the same chunk schedules, with only each row's live columns copied into one output
(:func:`~sglang_dsa_mtp.kernels.ops.attention.dsa_paged_mqa_logits_live.chunked_paged_mqa_logits_live`).
The top-k that follows reads only live columns, so it selects the same indices. Everything else goes
to SGLang's function unchanged: at most ``sm_count`` rows (no concat there), a logits function other
than SGLang's closure, the switch off, a kernel not compiled at start-up. The AFTER hook on
``Indexer.__init__`` compiles the copy kernel for the model's device, before any CUDA-graph capture.

SGLang's ``deepgemm_paged_mqa_logits_native`` (SM100 target verify, ``[B, next_n]`` queries) also
passes the closure, with requests as its batch; it chunks only above ``sm_count`` requests (148 on
B200, beyond SGLang's default of 48 running requests under speculative decoding) and is not hooked.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from sglang_dsa_mtp.integration.log import log_once
from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.switches import LIVE_WIDTH

# SGLang 0.5.23's closure, as ``deepgemm_paged_mqa_logits_split`` receives it.
CLOSURE_QUALNAME = "Indexer._get_topk_paged.<locals>._chunked_fp8_paged_mqa_logits"
SCHEDULE_FN = "resolve_paged_mqa_logits_metadata_fn"  # the closure's chunk-schedule resolver


EAGLE_DRAFT_TOKENS = {"3/1/4": 4, "4/1/5": 5, "5/1/6": 6}  # EAGLE steps/topk/draft tokens
H200_SMS = 132


def first_chunked_requests(num_sms: int, rows_per_request: int) -> int:
    """The fewest running requests whose rows (requests x rows per request) SGLang chunks."""
    return num_sms // rows_per_request + 1


def engagement(num_sms: Optional[int], *, sm100: bool = False) -> str:
    """When the live copy engages on a GPU with ``num_sms`` SMs (None: no GPU here), in words."""
    sms = num_sms or H200_SMS
    counts = " / ".join(str(first_chunked_requests(sms, n)) for n in EAGLE_DRAFT_TOKENS.values())
    where = f"this GPU's {sms} SMs" if num_sms else f"the GPU's SMs ({sms} on an H200)"
    modes = (
        "draft extend (SM100 target verify: past its SM count in requests)"
        if sm100
        else ("target verify and draft extend")
    )
    return (
        f"live_width engages where the DSA indexer's logits have more rows than {where}: {modes} "
        f"from {counts} running requests at EAGLE {', '.join(EAGLE_DRAFT_TOKENS)}; decode "
        f"without speculation from {sms + 1}"
    )


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
    if getattr(fn, "__qualname__", None) != CLOSURE_QUALNAME or code is None:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    indexer, blocksize = cells.get("self"), cells.get("blocksize")
    sm_count = getattr(indexer, "sm_count", None)
    resolve = fn.__globals__.get(SCHEDULE_FN)
    for value in (sm_count, blocksize):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
    if not callable(resolve):
        return None
    return _Closure(sm_count, blocksize, resolve)


def _why_not_live(closure, q_fp8, ctx_lens_2d, max_seq_len, q_offset) -> Optional[str]:
    """Why a call that SGLang chunks keeps SGLang's concat, or None when the live copy applies."""
    enabled, why = LIVE_WIDTH.state()
    if not enabled:
        return why
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
    try:
        closure = sglang_closure(fp8_paged_mqa_logits_fn)
        if closure is not None and q_offset <= closure.sm_count:
            return None  # one logits call, no concat to remove
        reason = _why_not_live(closure, q_fp8, ctx_lens_2d, max_seq_len, q_offset)
    except Exception as exc:  # never take the server down: SGLang's path stays
        reason = f"the gate raised {type(exc).__name__}: {exc}"
    if reason is not None:
        log_once(
            logging.INFO,
            ("live-logits-off", reason),
            "sglang_dsa_mtp: chunked indexer logits keep SGLang's full-width concat: %s",
            reason,
        )
        return None
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
        )
    except Exception as exc:
        log_once(
            logging.ERROR,
            ("live-logits-error", type(exc).__name__, str(exc)),
            "sglang_dsa_mtp: the live-column indexer logits raised %s: %s; SGLang's concat is used",
            type(exc).__name__,
            exc,
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


def warm_up_live_logits(result, indexer, *args, **kwargs):
    """AFTER ``Indexer.__init__``: compile the live-copy kernel for the current CUDA device, once."""
    try:
        if LIVE_WIDTH.enabled() and torch.cuda.is_available() and torch.version.hip is None:
            device = torch.device("cuda", torch.cuda.current_device())
            if not live.is_warm(device):
                live.warm_up(device)
    except Exception as exc:  # chunked calls then keep SGLang's concat (is_warm stays False)
        log_once(
            logging.ERROR,
            ("live-logits-warm-up", type(exc).__name__, str(exc)),
            "sglang_dsa_mtp: compiling the live-copy kernel raised %s: %s; chunked indexer logits "
            "keep SGLang's concat",
            type(exc).__name__,
            exc,
        )
    return result
