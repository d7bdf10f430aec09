"""What the bounded replay-metadata kernels share: the launch shape, the device code, the checks.

Used by ``dsa_metadata_bounded`` (decode, target verify, draft extend) and
``dsa_draft_decode_metadata`` (the MTP one launch). A launch has ``1 + programs`` programs, from
:func:`bounded_num_programs` (requests, width, budget; never the live lengths, so one CUDA-graph
capture serves every replay). Program 0 writes the length vectors; the others take every
``programs``-th live ``TILE_N``-column tile of the whole batch, or with one row per request a run of
consecutive ones (:func:`copy_live_tiles`), each read once and stored to every output row of its
request and every destination table. The write region is SGLang's, exactly: columns
``c < min(width, 128 * cdiv(kv_len, 128))`` per row; everything else keeps its contents. Details:
docs/switches.md, section "Bounded replay-metadata kernels".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from sglang_dsa_mtp.kernels.ops.host import (
    PROGRAMS_PER_SM,
    cdiv,
    default_budget,
    next_power_of_2,
)
from sglang_dsa_mtp.kernels.ops.launch import Launch

BLOCK_N = 128  # SGLang's column block: the write region is whole blocks of this many columns
TILE_N = 1024  # columns one program moves per loop iteration (a multiple of BLOCK_N)
NUM_WARPS = 4
NUM_STAGES = 3  # software-pipelined tile loads in each program's loop


def bounded_num_programs(requests: int, width: int, budget: int) -> int:
    """Tile programs of a launch: the budget, or fewer where the batch cannot have that many
    tiles (``requests * cdiv(width, TILE_N)``); at least one. Never depends on live lengths."""
    return max(1, min(budget, requests * cdiv(width, TILE_N)))


def block_requests(requests: int) -> int:
    """The lanes one program holds the per-request vectors in (a power of two, at least 2)."""
    return max(2, next_power_of_2(requests))


# ----------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------


@triton.jit
def copy_live_tiles(
    req_to_token,
    page_tables,
    real_page_tables,
    seq_lens,
    req_pool_indices,
    extend_seq_lens,
    program,
    num_programs,
    bs,
    width,
    total_len,
    seq_lens_stride,
    req_pool_indices_stride,
    extend_seq_lens_stride,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    KV_ADD: tl.constexpr,
    ROWS_PER_REQUEST: tl.constexpr,
    STATIC_EXTEND_LEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``program`` (of ``num_programs``)'s share of the batch's live tiles: global tiles
    ``program, program + num_programs, ...`` in request order (with ``ROWS_PER_REQUEST == 1``, the
    ``program``-th of ``num_programs`` equal runs of consecutive tiles), each into its request's
    rows of every table of ``page_tables`` / ``real_page_tables`` (tuples of one length, tables
    sharing their strides). A request's KV length is ``seq_lens + KV_ADD``; its rows are ``r`` (one per
    request, ``ROWS_PER_REQUEST == 1``), ``r * n .. + n`` (``ROWS_PER_REQUEST == n``), or, with
    ``ROWS_PER_REQUEST == 0`` (draft extend), its ``extend_seq_lens`` rows (none past
    ``total_len``), starting at ``r * extend_seq_lens[r]`` (``STATIC_EXTEND_LEN``) or after the
    rows of the requests before it. ``BLOCK_ROWS``: the most rows of one request (a constant;
    ``ROWS_PER_REQUEST`` where it is not 0). ``extend_seq_lens`` and ``total_len`` are read only
    where ``ROWS_PER_REQUEST == 0``."""
    offs_b = tl.arange(0, BLOCK_BS)
    mask_b = offs_b < bs
    kv = tl.load(seq_lens + offs_b * seq_lens_stride, mask=mask_b, other=0).to(tl.int32) + KV_ADD
    # Every request's slot, loaded beside its length: no load waits for the lengths.
    slots = tl.load(req_pool_indices + offs_b * req_pool_indices_stride, mask=mask_b, other=0)
    slots = slots.to(tl.int64)
    # Whole live 128-column blocks, the last one masked by the width: SGLang's write region.
    live_end = tl.where(mask_b & (kv > 0), tl.minimum(tl.cdiv(kv, BLOCK_N) * BLOCK_N, width), 0)
    tiles = tl.cdiv(live_end, TILE_N)
    tiles_end = tl.cumsum(tiles, 0)
    if ROWS_PER_REQUEST == 0:
        qo = tl.load(extend_seq_lens + offs_b * extend_seq_lens_stride, mask=mask_b, other=0)
        qo = qo.to(tl.int32)
        if STATIC_EXTEND_LEN:
            first_rows = offs_b * qo
        else:
            first_rows = tl.cumsum(qo, 0) - qo
        row_counts = tl.maximum(tl.minimum(tl.minimum(qo, BLOCK_ROWS), total_len - first_rows), 0)
    else:
        first_rows = offs_b * ROWS_PER_REQUEST
        row_counts = offs_b * 0 + ROWS_PER_REQUEST
    # This program's tiles: with one row per request (decode), a run of consecutive tiles (its
    # share of the batch's), so that it changes request rarely (each change is one reduction of the
    # request lanes, against one row to write per tile), its loads software-pipelined only where
    # the run has two tiles or more (the pipeline costs a run of one about a microsecond); with
    # several rows per request, every num_programs-th tile (the programs read neighbouring tiles
    # together), pipelined.
    total = tl.sum(tiles, 0)
    if ROWS_PER_REQUEST == 1:
        start = (program.to(tl.int64) * total // num_programs).to(tl.int32)
        stop = ((program + 1).to(tl.int64) * total // num_programs).to(tl.int32)
        step = 1
        pipelined = stop - start > 1
    else:
        start, stop, step, pipelined = program, total, num_programs, True
    lanes = (offs_b, tiles_end, tiles, live_end, first_rows, row_counts, slots)
    strides = (
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
    )
    tables = (req_to_token, page_tables, real_page_tables)
    if pipelined:
        _copy_tiles(
            tables,
            lanes,
            strides,
            start,
            stop,
            step,
            ROWS_PER_REQUEST,
            physical_page_size,
            HAS_PAGE_TABLE_1,
            HAS_REAL_PAGE_TABLE,
            TILE_N,
            NUM_STAGES,
        )
    else:
        _copy_tiles(
            tables,
            lanes,
            strides,
            start,
            stop,
            step,
            ROWS_PER_REQUEST,
            physical_page_size,
            HAS_PAGE_TABLE_1,
            HAS_REAL_PAGE_TABLE,
            TILE_N,
            1,
        )


@triton.jit
def _copy_tiles(
    tables,
    lanes,
    strides,
    start,
    stop,
    step,
    ROWS_PER_REQUEST: tl.constexpr,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Global tiles ``start, start + step, ...`` below ``stop`` into their requests' rows, the
    loads pipelined over ``NUM_STAGES`` stages: :func:`copy_live_tiles`'s loop, over its
    ``(req_to_token, page_tables, real_page_tables)``, its per-request lanes (lane index, tiles
    end, tiles, live end, first row, row count, slot) and its six strides."""
    req_to_token, page_tables, real_page_tables = tables
    offs_b, tiles_end, tiles, live_end, first_rows, row_counts, slots = lanes
    (
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
    ) = strides
    # The first tile's request; then, at each tile past the request's last, the next. (A program
    # with no tile, all of the batch's tiles before it, has req == BLOCK_BS.)
    req = tl.sum((tiles_end <= start).to(tl.int32), 0)
    tile_end, tile_start, end, first_row, num_rows, req_idx = _request_facts(
        req, offs_b, tiles_end, tiles, live_end, first_rows, row_counts, slots
    )
    for tile in tl.range(start, stop, step, num_stages=NUM_STAGES):
        if tile >= tile_end:
            req = tl.sum((tiles_end <= tile).to(tl.int32), 0)
            tile_end, tile_start, end, first_row, num_rows, req_idx = _request_facts(
                req, offs_b, tiles_end, tiles, live_end, first_rows, row_counts, slots
            )
        offs_n = (tile - tile_start) * TILE_N + tl.arange(0, TILE_N)
        mask = offs_n < end
        src = req_to_token + req_idx * req_to_token_stride_0 + offs_n * req_to_token_stride_1
        vals = tl.load(src, mask=mask, other=0).to(tl.int32)
        # page_table_1 offsets / values, then real_page_table's (one entry per page start).
        offs = offs_n * page_table_stride_1
        real_offs = (offs_n // physical_page_size) * real_page_table_stride_1
        real_vals = vals // physical_page_size
        real_mask = mask & ((offs_n % physical_page_size) == 0)
        # The request's rows: ROWS_PER_REQUEST of them (decode, target verify), or its num_rows
        # draft-extend rows. Each store is also masked by `r < num_rows` (true for every r the
        # loop takes): that use inside the loop keeps num_rows a live loop-carried value. Without
        # it, num_rows's only use is the bound of the nested loop, and Triton 3.6's
        # TritonGPURemoveLayoutConversions prunes such a value and puts its value from before the
        # loop in its place (upstream triton-lang/triton pull request 9036): every draft-extend
        # tile then wrote the row count of its program's first request, not of its own.
        for r in range(ROWS_PER_REQUEST if ROWS_PER_REQUEST > 0 else num_rows):
            row_live = (ROWS_PER_REQUEST > 0) | (r < num_rows)
            for d in tl.static_range(len(page_tables)):
                if HAS_PAGE_TABLE_1:
                    tl.store(
                        page_tables[d] + (first_row + r) * page_table_stride_0 + offs,
                        vals,
                        mask=mask & row_live,
                    )
                if HAS_REAL_PAGE_TABLE:
                    tl.store(
                        real_page_tables[d]
                        + (first_row + r) * real_page_table_stride_0
                        + real_offs,
                        real_vals,
                        mask=real_mask & row_live,
                    )


@triton.jit
def _request_facts(req, offs_b, tiles_end, tiles, live_end, first_rows, row_counts, slots):
    """Request ``req``'s last global tile + 1, its first global tile, its live end (columns), its
    first output row (int64), its number of rows and its slot (int64), from the per-request
    vectors (all 0 for a ``req`` past the lanes). One reduction of the six lanes' tuple: ``req``'s
    lane is the only one not zeroed, so each sum is that lane's value."""
    this = offs_b == req
    tile_end, req_tiles, end, first_row, num_rows, slot = tl.reduce(
        (
            tl.where(this, tiles_end, 0),
            tl.where(this, tiles, 0),
            tl.where(this, live_end, 0),
            tl.where(this, first_rows, 0),
            tl.where(this, row_counts, 0),
            tl.where(this, slots, 0),
        ),
        0,
        _add_each,
    )
    return tile_end, tile_end - req_tiles, end, first_row.to(tl.int64), num_rows, slot


@triton.jit
def _add_each(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5


@triton.jit
def store_cumsum_from_zero(cu, values, mask):
    """cu[0] = 0, cu[1 + i] = values[0] + ... + values[i] for the masked-in lanes."""
    tl.store(cu, tl.full((), 0, tl.int32))
    tl.store(cu + 1 + tl.arange(0, values.shape[0]), tl.cumsum(values, 0), mask=mask)


@triton.jit
def store_request_seqlens(
    seq_lens, seq_lens_stride, cache_seqlens, cu_seqlens_k, bs, add, BLOCK_BS: tl.constexpr
):
    """cache_seqlens[b] = seq_lens[b] + add and its zero-led cumsum; returns the loaded lengths."""
    offs_b = tl.arange(0, BLOCK_BS)
    mask_b = offs_b < bs
    seq = tl.load(seq_lens + offs_b * seq_lens_stride, mask=mask_b, other=0).to(tl.int32)
    tl.store(cache_seqlens + offs_b, seq + add, mask=mask_b)
    store_cumsum_from_zero(cu_seqlens_k, seq + add, mask_b)
    return seq


@triton.jit
def store_decode_seqlens(
    seq, mask_b, cache_seqlens, cu_seqlens_k, dsa_cache_seqlens, dsa_cu_seqlens_k, dsa_index_topk
):
    """Decode's length vectors, into every destination of the tuples, from the loaded lengths."""
    offs_b = tl.arange(0, seq.shape[0])
    dsa_seq = tl.minimum(seq, dsa_index_topk)
    for d in tl.static_range(len(cache_seqlens)):
        tl.store(cache_seqlens[d] + offs_b, seq, mask=mask_b)
        store_cumsum_from_zero(cu_seqlens_k[d], seq, mask_b)
        tl.store(dsa_cache_seqlens[d] + offs_b, dsa_seq, mask=mask_b)
        store_cumsum_from_zero(dsa_cu_seqlens_k[d], dsa_seq, mask_b)


@triton.jit
def store_expanded_seqlens(
    seqlens_expanded, dsa_cache_seqlens, dsa_cu_seqlens_k, expanded_seq, mask_e, dsa_index_topk
):
    """The per-row vectors of target verify and draft extend from the rows' lengths."""
    expanded_seq = tl.where(mask_e, expanded_seq, 0)
    dsa_seq = tl.minimum(expanded_seq, dsa_index_topk)
    offs_e = tl.arange(0, expanded_seq.shape[0])
    tl.store(seqlens_expanded + offs_e, expanded_seq, mask=mask_e)
    tl.store(dsa_cache_seqlens + offs_e, dsa_seq, mask=mask_e)
    store_cumsum_from_zero(dsa_cu_seqlens_k, dsa_seq, mask_e)


# ----------------------------------------------------------------------------------------------
# Argument checks (host-only: no device synchronization on the replay path)
# ----------------------------------------------------------------------------------------------


def check_int32(name, tensor, device, *, ndim):
    """``tensor`` is an int32 tensor of ``ndim`` dimensions on ``device``, else an error naming it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (where req_to_token is)")


def check_arguments(arguments: Mapping[str, Any], width: int, **outputs) -> None:
    """:func:`check_common` of a wrapper's arguments by name (``width``: its page-table width)."""
    check_common(
        arguments["seq_lens"],
        arguments["req_pool_indices"],
        arguments["req_to_token"],
        arguments["bs"],
        width,
        arguments["physical_page_size"],
        arguments["budget"],
        **outputs,
    )


def check_common(seq_lens, req_pool_indices, req_to_token, bs, width, page_size, budget, **outputs):
    """The arguments every replay-metadata wrapper takes, and its 1-D outputs given as
    ``name=(tensor, entries needed)``; raises naming the first argument that is wrong."""
    if not isinstance(req_to_token, torch.Tensor):
        raise TypeError(f"req_to_token must be a torch.Tensor, got {type(req_to_token).__name__}")
    device = req_to_token.device
    check_int32("req_to_token", req_to_token, device, ndim=2)
    if not isinstance(bs, int) or bs < 0:
        raise ValueError(f"bs must be a non-negative int, got {bs!r}")
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be None or an int >= 1, got {budget!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"physical_page_size must be an int >= 1, got {page_size!r}")
    if not isinstance(width, int) or not 0 <= width <= req_to_token.shape[1]:
        raise ValueError(
            f"the page-table width must be an int in [0, req_to_token.shape[1]="
            f"{req_to_token.shape[1]}], got {width!r}"
        )
    for name, tensor in (("seq_lens", seq_lens), ("req_pool_indices", req_pool_indices)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 or int64 tensor")
        if tensor.dim() != 1 or tensor.shape[0] < bs or tensor.device != device:
            raise ValueError(
                f"{name} must be 1-D with at least bs={bs} entries on {device}, "
                f"got shape {tuple(tensor.shape)} on {tensor.device}"
            )
    for name, (tensor, needed) in outputs.items():
        if name == "extend_seq_lens":
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (
                torch.int32,
                torch.int64,
            ):
                raise TypeError("extend_seq_lens must be an int32 or int64 tensor")
            if tensor.device != device or tensor.dim() != 1:
                raise ValueError(f"extend_seq_lens must be 1-D on {device}")
        else:
            check_int32(name, tensor, device, ndim=1)
        if tensor.shape[0] < needed:
            raise ValueError(f"{name} needs at least {needed} entries, got {tensor.shape[0]}")


def page_tables(page_table_1, real_page_table, rows, width, page_size, device):
    """Validate the two page tables; return (page_table_1, real_page_table, has_pt1, has_real)
    with a stand-in tensor for a table that is not written (its pointer is never dereferenced)."""
    has_pt1 = page_table_1 is not None
    has_real = page_size > 1
    if not has_pt1 and not has_real:
        raise ValueError("page_table_1 is required when physical_page_size == 1")
    if has_pt1:
        check_int32("page_table_1", page_table_1, device, ndim=2)
        if page_table_1.shape[0] < rows or page_table_1.shape[1] < width:
            raise ValueError(
                f"page_table_1 must be at least ({rows}, {width}), got {tuple(page_table_1.shape)}"
            )
    if has_real:
        if real_page_table is None:
            raise ValueError("real_page_table is required when physical_page_size > 1")
        check_int32("real_page_table", real_page_table, device, ndim=2)
        real_width = cdiv(width, page_size)
        if real_page_table.shape[0] < rows or real_page_table.shape[1] < real_width:
            raise ValueError(
                f"real_page_table must be at least ({rows}, cdiv(width, physical_page_size)="
                f"{real_width}), got {tuple(real_page_table.shape)}"
            )
    else:
        real_page_table = page_table_1
    if not has_pt1:
        page_table_1 = real_page_table
    return page_table_1, real_page_table, has_pt1, has_real


def zero_cumsum_heads(*cumsums: torch.Tensor) -> None:
    """What every wrapper writes at ``bs == 0``: entry 0 of each cumulative-length vector."""
    for cu in cumsums:
        cu[:1].zero_()


def bounded_launch(
    arguments: Mapping[str, Any],
    width: int,
    tables: tuple,
    *,
    programs_per_sm: int = PROGRAMS_PER_SM,
    num_warps: int | None = None,
    **kernel_arguments,
) -> Launch:
    """The launch of a bounded kernel for a wrapper's checked ``arguments`` (by name): ``1 +``
    :func:`bounded_num_programs` programs, the parameters every bounded kernel takes, then
    ``kernel_arguments``. ``tables``: what :func:`page_tables` returned, or its two tables as
    tuples of every destination's (the strides are the first one's). Without a ``budget`` argument,
    ``programs_per_sm`` make it (:func:`default_budget`); ``num_warps`` None: :data:`NUM_WARPS`."""
    page_table_1, real_page_table, has_pt1, has_real = tables
    seq_lens, req_to_token, bs = arguments["seq_lens"], arguments["req_to_token"], arguments["bs"]
    budget = arguments["budget"]
    budget = default_budget(seq_lens.device, programs_per_sm) if budget is None else budget
    num_programs = bounded_num_programs(bs, width, budget)
    table = page_table_1[0] if isinstance(page_table_1, tuple) else page_table_1
    real = real_page_table[0] if isinstance(real_page_table, tuple) else real_page_table
    return Launch(
        grid=(1 + num_programs,),
        arguments=dict(
            seq_lens=seq_lens,
            req_pool_indices=arguments["req_pool_indices"],
            req_to_token=req_to_token,
            page_table_1=page_table_1,
            real_page_table=real_page_table,
            seq_lens_stride=seq_lens.stride(0),
            req_pool_indices_stride=arguments["req_pool_indices"].stride(0),
            req_to_token_stride_0=req_to_token.stride(0),
            req_to_token_stride_1=req_to_token.stride(1),
            page_table_stride_0=table.stride(0),
            page_table_stride_1=table.stride(1),
            real_page_table_stride_0=real.stride(0),
            real_page_table_stride_1=real.stride(1),
            bs=bs,
            width=width,
            num_programs=num_programs,
            dsa_index_topk=arguments["dsa_index_topk"],
            physical_page_size=arguments["physical_page_size"],
            HAS_PAGE_TABLE_1=has_pt1,
            HAS_REAL_PAGE_TABLE=has_real,
            BLOCK_BS=block_requests(bs),
            BLOCK_N=BLOCK_N,
            TILE_N=TILE_N,
            NUM_STAGES=NUM_STAGES,
            **kernel_arguments,
        ),
        input_len=bs,
        options=dict(num_warps=NUM_WARPS if num_warps is None else num_warps),
    )
