"""Greedy (topk=1) draft token from vocab-parallel LM-head shards, through a sum all-reduce.

    exchange = draft_argmax_partials(logits_shard, tp_rank=r, tp_size=n, vocab_size=v)
    all_reduce(exchange)                       # SUM, in place, any implementation
    topk_p, topk_index = draft_argmax_finalize(exchange, positions, draft_tokens, column)

Bit-identical to the gathered fp32 logits' ``draft_topk1_postprocess`` (``nan_policy="sanitize"``)
or ``torch.argmax`` (``nan_policy="propagate"``), ties, infinities and NaN included. The exchange
buffer, ``float32 [rows, tp_size * splits_per_rank(shard_width) * 4]``, holds exact integers, so any
sum all-reduce (NCCL, custom, one-shot, Lamport) keeps it bit for bit. Both kernels are CUDA-graph
capturable; :func:`warm_up` compiles every variant the call sites launch. On a GPU of compute
capability 9.0 or later both launch as programmatic dependents (:func:`programmatic`): each may
start while the kernel before it finishes and waits for it before its first memory access, and
the partials let the kernel after them start at once. Details (layout, lanes, NaN rules):
docs/switches.md, section "The exchange buffer".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_dsa_mtp.kernels.ops.host import cdiv, next_power_of_2

SPLIT_N = 4096  # shard columns one partials program reduces (one load per program)
RUN_N = 8  # columns of a run: the column search reloads the first run holding the max
PARTIALS_NUM_WARPS = 4
FINALIZE_NUM_WARPS = 1  # one warp per row
LANES = 4  # fp32 lanes per candidate
MAX_VOCAB = 1 << 24  # lanes 2 and 3 store column and column + 1 exactly as fp32 integers
NAN_POLICIES = ("sanitize", "propagate")
LOGITS_DTYPES = (torch.bfloat16, torch.float32)


def splits_per_rank(shard_width: int) -> int:
    """Candidates each rank contributes per row: ``cdiv(shard_width, SPLIT_N)``."""
    if not isinstance(shard_width, int) or isinstance(shard_width, bool) or shard_width < 1:
        raise ValueError(f"shard_width must be an int >= 1, got {shard_width!r}")
    return cdiv(shard_width, SPLIT_N)


def exchange_shape(rows: int, shard_width: int, tp_size: int) -> tuple[int, int]:
    """Shape of the exchange buffer (the same on every rank): ``(rows, tp_size * splits * 4)``."""
    return rows, tp_size * splits_per_rank(shard_width) * LANES


@functools.cache
def programmatic(device: torch.device) -> bool:
    """Whether the kernels launch on ``device`` as programmatic dependents (PDL): compiled kernels
    (not Triton's interpreter) on a CUDA device of compute capability 9.0 or later. The kernels
    then wait for the kernel before them (``griddepcontrol.wait``) before their first load or
    store, so what they read and write is the same as in a plain launch."""
    return (
        device.type == "cuda"
        and isinstance(_draft_argmax_partials_kernel, triton.runtime.JITFunction)
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_dropping_nan(a, b):
    return tl.maximum(a, b)  # NaN only where both are


@triton.jit
def _search_run(
    row_logits, logits_stride_1, start, valid_width, best, BLOCK_RUN, WHOLE_RUNS, FIND_NAN
):
    """The lowest column of the run at ``start`` holding a NaN (``FIND_NAN``) or, NaN counted as
    -1e30, ``best`` (2**31 - 1 when none does)."""
    cols = start + tl.arange(0, BLOCK_RUN)
    if WHOLE_RUNS:
        mask = start < valid_width
    else:
        mask = cols < valid_width
    run = tl.load(row_logits + cols * logits_stride_1, mask=mask, other=float("-inf"))
    run = run.to(tl.float32)
    if FIND_NAN:
        hit = run != run
    else:
        hit = tl.where(run != run, -1e30, run) == best
    return tl.min(tl.where(hit, cols, 2147483647), 0)


@triton.jit
def _search_first_run_at_max(
    row_logits, logits_stride_1, split_start, valid_width, runs, run_best, best, BLOCK_RUN,
    WHOLE_RUNS,
):  # fmt: skip
    """The lowest column at ``best`` (NaN counted as -1e30): it is in the first run whose max
    ``best`` is, which is loaded again (its BLOCK_RUN columns, from the cache) and searched."""
    first_run = tl.min(tl.where(run_best == best, runs, 2147483647), 0)
    start = split_start + first_run * BLOCK_RUN
    return _search_run(
        row_logits, logits_stride_1, start, valid_width, best, BLOCK_RUN, WHOLE_RUNS, False
    )


@triton.jit(do_not_specialize=["tp_rank", "col_base", "valid_width"])
def _draft_argmax_partials_kernel(
    logits,
    out,
    logits_stride_0,
    logits_stride_1,
    out_stride_0,
    out_stride_1,
    tp_rank,
    tp_size,
    splits,
    col_base,
    valid_width,
    BLOCK_N: tl.constexpr,
    BLOCK_RUN: tl.constexpr,
    BLOCK_TP: tl.constexpr,
    LANES: tl.constexpr,
    WHOLE_RUNS: tl.constexpr,
    PROGRAMMATIC: tl.constexpr,
):
    if PROGRAMMATIC:
        gdc_wait()  # the kernel before (the logits' writer) is done; its writes are visible
        gdc_launch_dependents()  # the kernel after may start: it waits for this one in turn
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_logits = logits + row * logits_stride_0
    # The split as runs of BLOCK_RUN consecutive columns: [run, column in run]. Masked lanes read
    # -inf: they sit at higher columns than every valid one, so the lowest column at the max is a
    # valid one whenever the split has one. With WHOLE_RUNS (valid_width a multiple of BLOCK_RUN)
    # a run is valid whole or not at all, so the mask is one per run, which keeps the load
    # vectorized; bf16 -> fp32 is exact.
    runs = tl.arange(0, BLOCK_N // BLOCK_RUN)
    run_start = split * BLOCK_N + runs * BLOCK_RUN
    offs = run_start[:, None] + tl.arange(0, BLOCK_RUN)[None, :]
    if WHOLE_RUNS:
        mask = (run_start < valid_width)[:, None]
    else:
        mask = offs < valid_width
    vals = tl.load(row_logits + offs * logits_stride_1, mask=mask, other=float("-inf"))
    # The max (a NaN kept, so that a split holding one shows), by run, then of the runs.
    run_best = tl.reduce(vals.to(tl.float32), 1, _max_keeping_nan)
    best = tl.reduce(run_best, 0, _max_keeping_nan)
    split_start = split * BLOCK_N
    if best != best:
        # A NaN (rare). The first NaN column is in the first run whose max is NaN. The max with
        # NaN as -1e30, as draft_topk1_postprocess counts it: a run without a NaN keeps its max; a
        # run with one takes the larger of -1e30 and the max of its other columns (its values
        # reduced again without NaN). Both columns are then searched in the first run holding
        # them, the two runs loaded again together (-0.0 and +0.0 compare equal, as in
        # torch.argmax).
        nan_run = run_best != run_best
        first_nan_run = tl.min(tl.where(nan_run, runs, 2147483647), 0)
        run_others = tl.reduce(vals.to(tl.float32), 1, _max_dropping_nan)
        run_others = tl.maximum(tl.where(run_others != run_others, -1e30, run_others), -1e30)
        run_best = tl.where(nan_run, run_others, run_best)
        best = tl.max(run_best, 0)
        first_nan = _search_run(
            row_logits, logits_stride_1, split_start + first_nan_run * BLOCK_RUN, valid_width,
            best, BLOCK_RUN, WHOLE_RUNS, True,
        )  # fmt: skip
        local = _search_first_run_at_max(
            row_logits, logits_stride_1, split_start, valid_width, runs, run_best, best,
            BLOCK_RUN, WHOLE_RUNS,
        )  # fmt: skip
    else:
        first_nan = 2147483647
        local = _search_first_run_at_max(
            row_logits, logits_stride_1, split_start, valid_width, runs, run_best, best,
            BLOCK_RUN, WHOLE_RUNS,
        )  # fmt: skip
    # The max's order-preserving key: its fp32 bits (-0.0 as +0.0), negatives with the magnitude
    # bits flipped; as unsigned, 0 exactly when the split has no valid column.
    bits = best.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    has_valid = split * BLOCK_N < valid_width
    ukey = tl.where(has_valid, key.to(tl.int64) + 2147483648, 0)
    key_hi = (ukey >> 16).to(tl.float32)
    key_lo = (ukey & 0xFFFF).to(tl.float32)
    index = tl.where(has_valid, col_base + local, 0).to(tl.float32)
    nan_lane = tl.where(first_nan < valid_width, col_base + first_nan + 1, 0).to(tl.float32)

    ranks = tl.arange(0, BLOCK_TP)[:, None]
    lane = tl.arange(0, LANES)[None, :]
    candidate = tl.where(
        lane == 0, key_hi, tl.where(lane == 1, key_lo, tl.where(lane == 2, index, nan_lane))
    )
    # This rank's slot gets the candidate, every other rank's slot of this split exact +0.0.
    values = tl.where(ranks == tp_rank, candidate, 0.0)
    column = (ranks * splits + split) * LANES + lane
    tl.store(out + row * out_stride_0 + column * out_stride_1, values, mask=ranks < tp_size)


@triton.jit(do_not_specialize=["draft_token_column"])
def _draft_argmax_finalize_kernel(
    exchange,
    topk_p,
    topk_index,
    positions,
    draft_tokens,
    exchange_stride_0,
    exchange_stride_slot,
    exchange_stride_lane,
    positions_stride,
    draft_tokens_stride_0,
    draft_tokens_stride_1,
    draft_token_column,
    num_slots,
    PROPAGATE_NAN: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    WRITE_DRAFT_TOKEN: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    PROGRAMMATIC: tl.constexpr,
):
    if PROGRAMMATIC:
        gdc_wait()  # the exchange's writer (the partials, or the all-reduce) is done
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_SLOTS)
    mask = slots < num_slots
    base = exchange + row * exchange_stride_0 + slots * exchange_stride_slot
    key_hi = tl.load(base, mask=mask, other=0.0).to(tl.int64)
    key_lo = tl.load(base + exchange_stride_lane, mask=mask, other=0.0).to(tl.int64)
    index = tl.load(base + 2 * exchange_stride_lane, mask=mask, other=0.0).to(tl.int64)
    # The max key at its lowest column in one reduction: key << 24 | reversed column (< 2**24).
    packed = (key_hi * 65536 + key_lo) << 24 | (0xFFFFFF - index)
    token = 0xFFFFFF - (tl.max(packed, axis=0) & 0xFFFFFF)
    if PROPAGATE_NAN:
        nan_lane = tl.load(base + 3 * exchange_stride_lane, mask=mask, other=0.0).to(tl.int64)
        first_nan = tl.min(tl.where(mask & (nan_lane > 0), nan_lane - 1, 2147483647), axis=0)
        token = tl.where(first_nan < 2147483647, first_nan, token)

    tl.store(topk_index + row, token)
    tl.store(topk_p + row, 1.0)
    if WRITE_DRAFT_TOKEN:
        tl.store(
            draft_tokens + row * draft_tokens_stride_0 + draft_token_column * draft_tokens_stride_1,
            token,
        )
    if HAS_POSITIONS:
        position = tl.load(positions + row * positions_stride)
        tl.store(positions + row * positions_stride, position + 1)


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------


class PartialsLayout(NamedTuple):
    """One rank's share of the exchange, fixed for a deployment: see :func:`partials_layout`."""

    shard_width: int
    tp_rank: int
    tp_size: int
    vocab_size: int
    splits: int  # candidates per row from this rank
    col_base: int  # the global column of the shard's first column
    valid_width: int  # the shard's columns below vocab_size (the rest is padding)
    whole_runs: bool  # every rank's valid_width a multiple of RUN_N: one load mask per run


def partials_layout(*, shard_width: int, tp_rank: int, tp_size: int, vocab_size: int):
    """The checked launch layout of rank ``tp_rank`` of ``tp_size`` owning ``shard_width`` columns of
    a ``vocab_size`` vocabulary; raises naming the argument that is wrong."""
    _check_int("shard_width", shard_width, low=1)
    _check_int("tp_size", tp_size, low=1)
    _check_int("tp_rank", tp_rank, low=0)
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank must be < tp_size ({tp_size}), got {tp_rank}")
    _check_int("vocab_size", vocab_size, low=1)
    if vocab_size > tp_size * shard_width:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be <= tp_size * shard_width "
            f"({tp_size} * {shard_width} = {tp_size * shard_width})"
        )
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size must be <= {MAX_VOCAB} (exact fp32 lanes), got {vocab_size}")
    col_base = tp_rank * shard_width
    return PartialsLayout(
        shard_width,
        tp_rank,
        tp_size,
        vocab_size,
        splits_per_rank(shard_width),
        col_base,
        max(0, min(shard_width, vocab_size - col_base)),
        # The same on every rank (each valid_width is shard_width, vocab_size - col_base or 0), so
        # that warm_up, which lays out rank 0, compiles the variant every rank launches.
        shard_width % RUN_N == 0 and vocab_size % RUN_N == 0,
    )


def draft_argmax_partials(
    logits_shard: torch.Tensor,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's exchange buffer: its shard's argmax candidates, zero in every other rank's slot.

    ``logits_shard``: ``[rows, shard_width]`` bf16 or fp32 (any strides), the LM-head logits of
    global columns ``tp_rank * shard_width ...``; columns at global index ``>= vocab_size`` are
    padding and never read. ``out``: optional persistent fp32 buffer of
    :func:`exchange_shape` ``(rows, shard_width, tp_size)``, overwritten whole. Returns ``out`` (or a
    new buffer). Sum it over the TP group (any sum all-reduce), then :func:`draft_argmax_finalize`.
    """
    if not isinstance(logits_shard, torch.Tensor):
        raise TypeError(f"logits_shard must be a torch.Tensor, got {type(logits_shard).__name__}")
    if logits_shard.dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_shard must be bfloat16 or float32, got {logits_shard.dtype}")
    if logits_shard.dim() != 2:
        raise ValueError(
            f"logits_shard must be 2-D [rows, shard_width], got shape {tuple(logits_shard.shape)}"
        )
    rows, shard_width = logits_shard.shape
    if shard_width < 1:
        raise ValueError(f"logits_shard must have at least one column, got shape {(rows, 0)}")
    layout = partials_layout(
        shard_width=shard_width, tp_rank=tp_rank, tp_size=tp_size, vocab_size=vocab_size
    )
    if out is not None:
        shape = exchange_shape(rows, shard_width, tp_size)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.float32:
            raise TypeError(f"out must be float32, got {out.dtype}")
        if tuple(out.shape) != shape:
            raise ValueError(
                f"out must have shape {shape} (rows, tp_size * splits_per_rank * {LANES}), "
                f"got {tuple(out.shape)}"
            )
        if out.device != logits_shard.device:
            raise ValueError(
                f"out is on {out.device}, expected {logits_shard.device} (where logits_shard is)"
            )
    return launch_partials(layout, logits_shard, out)


def launch_partials(
    layout: PartialsLayout, logits_shard: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`draft_argmax_partials` with its checks done ahead: ``layout`` from
    :func:`partials_layout`, ``logits_shard`` a 2-D bf16 or fp32 ``[rows, layout.shard_width]``
    tensor, ``out`` None or a matching buffer. Launches without checking anything (the per-step
    path of a deployment whose checks ran at its opt-in)."""
    rows = logits_shard.shape[0]
    if out is None:
        out = torch.empty(
            (rows, layout.tp_size * layout.splits * LANES),
            dtype=torch.float32,
            device=logits_shard.device,
        )
    if rows == 0:
        return out
    pdl = programmatic(logits_shard.device)
    _draft_argmax_partials_kernel[(rows, layout.splits)](
        logits_shard,
        out,
        logits_shard.stride(0),
        logits_shard.stride(1),
        out.stride(0),
        out.stride(1),
        layout.tp_rank,
        layout.tp_size,
        layout.splits,
        layout.col_base,
        layout.valid_width,
        BLOCK_N=SPLIT_N,
        BLOCK_RUN=min(RUN_N, SPLIT_N),
        BLOCK_TP=next_power_of_2(layout.tp_size),
        LANES=LANES,
        WHOLE_RUNS=layout.whole_runs,
        PROGRAMMATIC=pdl,
        num_warps=PARTIALS_NUM_WARPS,
        launch_pdl=pdl,
    )
    return out


def draft_argmax_finalize(
    exchange: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    draft_tokens: Optional[torch.Tensor] = None,
    draft_token_column: int = 0,
    *,
    nan_policy: str = "sanitize",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each row's token from the all-reduced exchange buffer: ``(topk_p, topk_index)``.

    ``exchange``: the sum over the TP group of :func:`draft_argmax_partials` buffers, fp32
    ``[rows, slots * 4]`` (or ``[rows, slots, 4]``). ``nan_policy="sanitize"``: the token of
    SGLang's ``draft_topk1_postprocess`` on the gathered fp32 logits (NaN counts as -1e30, lowest
    index among the maxima, an all-NaN row gives 0); ``"propagate"``: the token of ``torch.argmax``
    (the first NaN wins, else the lowest index among the maxima). Returns ``topk_p`` fp32
    ``[rows, 1]`` = 1.0 and ``topk_index`` int64 ``[rows, 1]``, as ``draft_topk1_postprocess`` does.
    ``positions`` (1-D int32/int64, ``rows`` entries) advance by one in place when given;
    ``draft_tokens[:, draft_token_column]`` (int64 ``[rows, columns]``) receives the token when given.
    """
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
    if not isinstance(exchange, torch.Tensor):
        raise TypeError(f"exchange must be a torch.Tensor, got {type(exchange).__name__}")
    if exchange.dtype != torch.float32:
        raise TypeError(f"exchange must be float32, got {exchange.dtype}")
    if not (
        (exchange.dim() == 2 and exchange.shape[1] % LANES == 0 and exchange.shape[1] > 0)
        or (exchange.dim() == 3 and exchange.shape[2] == LANES and exchange.shape[1] > 0)
    ):
        raise ValueError(
            f"exchange must be [rows, slots * {LANES}] or [rows, slots, {LANES}] with slots >= 1, "
            f"got shape {tuple(exchange.shape)}"
        )
    rows, device = exchange.shape[0], exchange.device
    if positions is not None:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
        if positions.dim() != 1 or positions.shape[0] != rows:
            raise ValueError(
                f"positions must be 1-D with rows={rows} entries, got shape {tuple(positions.shape)}"
            )
        if positions.device != device:
            raise ValueError(f"positions is on {positions.device}, expected {device}")
    if draft_tokens is not None:
        if not isinstance(draft_tokens, torch.Tensor):
            raise TypeError(
                f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}"
            )
        if draft_tokens.dtype != torch.int64:
            raise TypeError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
        if draft_tokens.dim() != 2 or draft_tokens.shape[0] != rows:
            raise ValueError(
                f"draft_tokens must be 2-D with rows={rows} rows, "
                f"got shape {tuple(draft_tokens.shape)}"
            )
        if draft_tokens.device != device:
            raise ValueError(f"draft_tokens is on {draft_tokens.device}, expected {device}")
        _check_int("draft_token_column", draft_token_column, low=0)
        if draft_token_column >= draft_tokens.shape[1]:
            raise ValueError(
                f"draft_token_column must be < draft_tokens.shape[1] ({draft_tokens.shape[1]}), "
                f"got {draft_token_column}"
            )
    return launch_finalize(
        exchange,
        positions,
        draft_tokens,
        draft_token_column,
        propagate_nan=nan_policy == "propagate",
    )


def launch_finalize(
    exchange: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    draft_tokens: Optional[torch.Tensor] = None,
    draft_token_column: int = 0,
    *,
    propagate_nan: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_argmax_finalize` without its checks (``nan_policy="propagate"`` is
    ``propagate_nan=True``): the per-step path, whose arguments SGLang's worker builds the same way
    at every step of a deployment checked at its opt-in."""
    if exchange.dim() == 2:
        num_slots = exchange.shape[1] // LANES
        stride_slot, stride_lane = LANES * exchange.stride(1), exchange.stride(1)
    else:
        num_slots = exchange.shape[1]
        stride_slot, stride_lane = exchange.stride(1), exchange.stride(2)
    rows, device = exchange.shape[0], exchange.device
    topk_p = torch.empty((rows, 1), dtype=torch.float32, device=device)
    topk_index = torch.empty((rows, 1), dtype=torch.int64, device=device)
    if rows == 0:
        return topk_p, topk_index
    has_positions, write_draft_token = positions is not None, draft_tokens is not None
    pdl = programmatic(device)
    _draft_argmax_finalize_kernel[(rows,)](
        exchange,
        topk_p,
        topk_index,
        positions if has_positions else topk_index,  # stand-ins are never dereferenced
        draft_tokens if write_draft_token else topk_index,
        exchange.stride(0),
        stride_slot,
        stride_lane,
        positions.stride(0) if has_positions else 0,
        draft_tokens.stride(0) if write_draft_token else 0,
        draft_tokens.stride(1) if write_draft_token else 0,
        draft_token_column if write_draft_token else 0,
        num_slots,
        PROPAGATE_NAN=propagate_nan,
        HAS_POSITIONS=has_positions,
        WRITE_DRAFT_TOKEN=write_draft_token,
        BLOCK_SLOTS=next_power_of_2(num_slots),
        PROGRAMMATIC=pdl,
        num_warps=FINALIZE_NUM_WARPS,
        launch_pdl=pdl,
    )
    return topk_p, topk_index


def warm_up(
    *,
    rows: Sequence[int],
    shard_width: int,
    tp_size: int,
    vocab_size: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    draft_steps: Optional[int] = None,
) -> tuple[str, ...]:
    """Compile every variant the greedy draft's call sites launch, on scratch tensors only.

    ``rows``: the row counts the calls will have (the captured batch sizes); ``shard_width``,
    ``tp_size``, ``vocab_size``: the LM head's layout; ``dtypes``: the logits dtypes its matmul can
    produce (bf16 and/or fp32); ``draft_steps``: the columns of the draft-token buffer the draft
    decode pick writes (``--speculative-num-steps``), or None when it writes none.

    Launches :func:`draft_argmax_partials` once per dtype, and :func:`draft_argmax_finalize` as
    its three call sites do: ``sanitize`` with positions and a ``[rows, draft_steps]`` draft-token
    buffer, ``sanitize`` with positions only (draft decode: a chain that does not fit), and
    ``propagate`` alone (draft extend), with int64 positions and tokens, as SGLang passes them.
    A row count only sizes the grid of both kernels (no argument, hence no Triton specialization,
    depends on it), so each variant is launched once, at the smallest of ``rows``; the GPU test
    ``test_draft_argmax_compiles.py`` sweeps every row count after this and counts zero compiles.
    Nothing outside the scratch tensors is read or written. Returns the variants launched.
    """
    rows = list(rows)
    if not rows or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in rows):
        raise ValueError(f"rows must be a non-empty sequence of ints >= 1, got {rows!r}")
    dtypes = tuple(dict.fromkeys(dtypes))
    if not dtypes or any(dtype not in LOGITS_DTYPES for dtype in dtypes):
        raise ValueError(f"dtypes must be a non-empty choice of {LOGITS_DTYPES}, got {dtypes!r}")
    _check_int("shard_width", shard_width, low=1)
    if draft_steps is not None:
        _check_int("draft_steps", draft_steps, low=1)
    scratch_rows = min(rows)
    variants, exchange = [], None
    for dtype in dtypes:
        logits = torch.zeros((scratch_rows, shard_width), dtype=dtype, device=device)
        exchange = draft_argmax_partials(logits, tp_rank=0, tp_size=tp_size, vocab_size=vocab_size)
        variants.append(f"partials {str(dtype).removeprefix('torch.')}")
    positions = torch.zeros(scratch_rows, dtype=torch.int64, device=device)
    if draft_steps is not None:
        draft_tokens = torch.zeros((scratch_rows, draft_steps), dtype=torch.int64, device=device)
        draft_argmax_finalize(exchange, positions, draft_tokens, draft_steps - 1)
        variants.append("finalize sanitize, positions and draft tokens")
    draft_argmax_finalize(exchange, positions)
    variants.append("finalize sanitize, positions")
    draft_argmax_finalize(exchange, nan_policy="propagate")
    variants.append("finalize propagate")
    return tuple(variants)


def _check_int(name: str, value, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
