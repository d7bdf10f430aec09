"""Bounded DSA replay-metadata kernels: decode, target verify and draft extend.

Drop-in variants of ``fused_dsa_decode_metadata``, ``fused_dsa_target_verify_metadata`` and
``fused_dsa_draft_extend_metadata`` (``sglang/kernels/ops/attention/dsa/metadata.py``, SGLang 0.5.23):
the same keyword arguments and outputs, bit for bit, plus ``budget``.

SGLang's kernels launch one program per (row, 128-column block) of the context-wide page table, so a
1M-token table costs ``1 + rows * 8193`` programs per replay whatever the live KV length. Here a
launch is ``1 + bounded_num_programs(requests, width, budget)`` programs (a function of the shapes
and the budget, never of the live lengths): program 0 writes the length vectors, the others share
the batch's live tiles, each tile read once from ``req_to_token`` and written into every page-table
row of its request (all ``next_n`` verify rows, all draft-extend rows of the request). The launch
shape, the device code and the write region are ``dsa_metadata_common``'s. The decode kernel takes
tuples of destination buffers: one for the decode replay, one per MTP draft step backend for
``dsa_draft_decode_metadata``'s one launch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_common import (
    bounded_launch,
    check_arguments,
    check_int32,
    copy_live_tiles,
    page_tables,
    store_decode_seqlens,
    store_expanded_seqlens,
    store_request_seqlens,
    zero_cumsum_heads,
)
from sglang_dsa_mtp.kernels.ops.host import PROGRAMS_PER_SM, next_power_of_2
from sglang_dsa_mtp.kernels.ops.launch import Binder, Launch

# Defaults that depend on the batch size (never on the live lengths; the budget exploration in
# docs/results.md): the decode replay of 16 requests or more takes 8 programs per SM without a
# budget, draft extend of 32 requests or more 8 warps. The MTP one launch keeps 4 programs per SM.
DECODE_MANY_REQUESTS, DECODE_MANY_PROGRAMS_PER_SM = 16, 8
DRAFT_EXTEND_MANY_REQUESTS, DRAFT_EXTEND_MANY_WARPS = 32, 8


def decode_programs_per_sm(bs: int) -> int:
    """Programs per SM of the decode replay's default budget at ``bs`` requests."""
    return DECODE_MANY_PROGRAMS_PER_SM if bs >= DECODE_MANY_REQUESTS else PROGRAMS_PER_SM


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "width",
        "num_programs",
        "page_table_stride_0",
        "real_page_table_stride_0",
    ],
    do_not_specialize_on_alignment=["seq_lens", "req_pool_indices"],
)
def bounded_decode_metadata_kernel(
    seq_lens,
    req_pool_indices,
    req_to_token,
    cache_seqlens,
    cu_seqlens_k,
    page_table_1,
    dsa_cache_seqlens,
    dsa_cu_seqlens_k,
    real_page_table,
    seq_lens_stride,
    req_pool_indices_stride,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    bs,
    width,
    num_programs,
    dsa_index_topk,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Each output buffer argument is a tuple: that buffer of every destination (one for the
    # decode replay, one per MTP draft step backend for the one launch), with shared strides.
    pid = tl.program_id(0)
    if pid == 0:
        offs_b = tl.arange(0, BLOCK_BS)
        mask_b = offs_b < bs
        seq = tl.load(seq_lens + offs_b * seq_lens_stride, mask=mask_b, other=0).to(tl.int32)
        store_decode_seqlens(
            seq,
            mask_b,
            cache_seqlens,
            cu_seqlens_k,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            dsa_index_topk,
        )
        return

    copy_live_tiles(
        req_to_token=req_to_token,
        page_tables=page_table_1,
        real_page_tables=real_page_table,
        seq_lens=seq_lens,
        req_pool_indices=req_pool_indices,
        extend_seq_lens=seq_lens,  # not read: one row per request
        program=pid - 1,
        num_programs=num_programs,
        bs=bs,
        width=width,
        total_len=0,  # not read: one row per request
        seq_lens_stride=seq_lens_stride,
        req_pool_indices_stride=req_pool_indices_stride,
        extend_seq_lens_stride=0,
        req_to_token_stride_0=req_to_token_stride_0,
        req_to_token_stride_1=req_to_token_stride_1,
        page_table_stride_0=page_table_stride_0,
        page_table_stride_1=page_table_stride_1,
        real_page_table_stride_0=real_page_table_stride_0,
        real_page_table_stride_1=real_page_table_stride_1,
        KV_ADD=0,
        ROWS_PER_REQUEST=1,
        STATIC_EXTEND_LEN=False,  # not read
        BLOCK_ROWS=1,
        physical_page_size=physical_page_size,
        HAS_PAGE_TABLE_1=HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE=HAS_REAL_PAGE_TABLE,
        BLOCK_BS=BLOCK_BS,
        BLOCK_N=BLOCK_N,
        TILE_N=TILE_N,
        NUM_STAGES=NUM_STAGES,
    )


def fused_dsa_decode_metadata_bounded(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table_1: Optional[torch.Tensor],
    dsa_cache_seqlens: torch.Tensor,
    dsa_cu_seqlens_k: torch.Tensor,
    real_page_table: Optional[torch.Tensor],
    bs: int,
    max_len: int,
    dsa_index_topk: int,
    physical_page_size: int,
    budget: Optional[int] = None,
) -> None:
    """Decode replay metadata, bit-identical to SGLang's ``fused_dsa_decode_metadata``.

    ``budget``: the most page-table programs one launch may use (at least 1; the batch's live
    tiles are shared among them, whatever the number of requests); None uses
    :func:`default_budget` with :func:`decode_programs_per_sm`. ``page_table_1=None`` is allowed when
    ``physical_page_size > 1`` (only ``real_page_table`` is written); with page size 1
    ``real_page_table`` is ``page_table_1``.
    """
    launch = _decode_launch(locals())
    if launch is not None:
        bounded_decode_metadata_kernel[launch.grid](**launch.arguments, **launch.options)


def _decode_launch(a: Mapping[str, Any]) -> Optional[Launch]:
    bs, width = a["bs"], a["max_len"]
    check_arguments(
        a,
        width,
        cache_seqlens=(a["cache_seqlens"], bs),
        cu_seqlens_k=(a["cu_seqlens_k"], bs + 1),
        dsa_cache_seqlens=(a["dsa_cache_seqlens"], bs),
        dsa_cu_seqlens_k=(a["dsa_cu_seqlens_k"], bs + 1),
    )
    if bs == 0:
        zero_cumsum_heads(a["cu_seqlens_k"], a["dsa_cu_seqlens_k"])
        return None
    tables = page_tables(
        a["page_table_1"],
        a["real_page_table"],
        bs,
        width,
        a["physical_page_size"],
        a["req_to_token"].device,
    )
    return decode_launch(a, width, [a], [tables], programs_per_sm=decode_programs_per_sm(bs))


def decode_launch(
    a: Mapping[str, Any],
    width: int,
    destinations: Sequence,
    tables: Sequence[tuple],
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> Launch:
    """The decode kernel's launch into every one of ``destinations`` (checked: mappings of the
    length vectors by name), with each one's :func:`page_tables` in ``tables``; without a
    ``budget``, ``programs_per_sm`` make it."""
    return bounded_launch(
        a,
        width,
        (*(tuple(t[i] for t in tables) for i in (0, 1)), *tables[0][2:]),
        programs_per_sm=programs_per_sm,
        **{name: tuple(dest[name] for dest in destinations) for name in LENGTH_VECTORS},
    )


_DECODE = Binder(
    "decode", bounded_decode_metadata_kernel, 2, _decode_launch, fused_dsa_decode_metadata_bounded
)
# A decode destination's length vectors, as the decode kernel and its wrapper name them.
LENGTH_VECTORS = ("cache_seqlens", "cu_seqlens_k", "dsa_cache_seqlens", "dsa_cu_seqlens_k")


# The outputs of target verify and draft extend, as their kernels and wrappers name them.
EXPANDED_OUTPUTS = (
    "cache_seqlens",
    "cu_seqlens_k",
    "seqlens_expanded",
    "dsa_cache_seqlens",
    "dsa_cu_seqlens_k",
)


def check_expanded(a: Mapping[str, Any], width: int, rows: int, **inputs) -> None:
    """:func:`check_arguments` of target verify and draft extend: ``inputs``, then the per-request
    length vectors and those of their ``rows`` expanded rows."""
    bs = a["bs"]
    check_arguments(
        a,
        width,
        **inputs,
        cache_seqlens=(a["cache_seqlens"], bs),
        cu_seqlens_k=(a["cu_seqlens_k"], bs + 1),
        seqlens_expanded=(a["seqlens_expanded"], rows),
        dsa_cache_seqlens=(a["dsa_cache_seqlens"], rows),
        dsa_cu_seqlens_k=(a["dsa_cu_seqlens_k"], rows + 1),
    )


# ----------------------------------------------------------------------------------------------
# Target verify
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "width",
        "num_programs",
        "page_table_stride_0",
        "real_page_table_stride_0",
    ],
    do_not_specialize_on_alignment=["seq_lens", "req_pool_indices"],
)
def _bounded_target_verify_metadata_kernel(
    seq_lens,
    req_pool_indices,
    req_to_token,
    cache_seqlens,
    cu_seqlens_k,
    page_table_1,
    seqlens_expanded,
    dsa_cache_seqlens,
    dsa_cu_seqlens_k,
    real_page_table,
    paged_mqa_ctx_lens_2d,
    seq_lens_stride,
    req_pool_indices_stride,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    ctx_lens_stride_0,
    ctx_lens_stride_1,
    bs,
    width,
    num_programs,
    dsa_index_topk,
    next_n: tl.constexpr,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    HAS_CTX_LENS_2D: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_EXPANDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid == 0:
        store_request_seqlens(
            seq_lens, seq_lens_stride, cache_seqlens, cu_seqlens_k, bs, next_n, BLOCK_BS
        )
        offs_e = tl.arange(0, BLOCK_EXPANDED)
        mask_e = offs_e < bs * next_n
        req_of_e = offs_e // next_n
        draft_of_e = offs_e - req_of_e * next_n
        base = tl.load(seq_lens + req_of_e * seq_lens_stride, mask=mask_e, other=0).to(tl.int32)
        store_expanded_seqlens(
            seqlens_expanded,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            base + draft_of_e + 1,
            mask_e,
            dsa_index_topk,
        )
        if HAS_CTX_LENS_2D:
            tl.store(
                paged_mqa_ctx_lens_2d
                + req_of_e * ctx_lens_stride_0
                + draft_of_e * ctx_lens_stride_1,
                base + next_n,
                mask=mask_e,
            )
        return

    copy_live_tiles(
        req_to_token=req_to_token,
        page_tables=(page_table_1,),
        real_page_tables=(real_page_table,),
        seq_lens=seq_lens,
        req_pool_indices=req_pool_indices,
        extend_seq_lens=seq_lens,  # not read: next_n rows per request
        program=pid - 1,
        num_programs=num_programs,
        bs=bs,
        width=width,
        total_len=0,  # not read: next_n rows per request
        seq_lens_stride=seq_lens_stride,
        req_pool_indices_stride=req_pool_indices_stride,
        extend_seq_lens_stride=0,
        req_to_token_stride_0=req_to_token_stride_0,
        req_to_token_stride_1=req_to_token_stride_1,
        page_table_stride_0=page_table_stride_0,
        page_table_stride_1=page_table_stride_1,
        real_page_table_stride_0=real_page_table_stride_0,
        real_page_table_stride_1=real_page_table_stride_1,
        KV_ADD=next_n,
        ROWS_PER_REQUEST=next_n,
        STATIC_EXTEND_LEN=False,  # not read
        BLOCK_ROWS=next_n,
        physical_page_size=physical_page_size,
        HAS_PAGE_TABLE_1=HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE=HAS_REAL_PAGE_TABLE,
        BLOCK_BS=BLOCK_BS,
        BLOCK_N=BLOCK_N,
        TILE_N=TILE_N,
        NUM_STAGES=NUM_STAGES,
    )


def fused_dsa_target_verify_metadata_bounded(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table_1: Optional[torch.Tensor],
    seqlens_expanded: torch.Tensor,
    dsa_cache_seqlens: torch.Tensor,
    dsa_cu_seqlens_k: torch.Tensor,
    real_page_table: Optional[torch.Tensor],
    bs: int,
    max_seqlen_k: int,
    dsa_index_topk: int,
    physical_page_size: int,
    next_n: int,
    paged_mqa_ctx_lens_2d: Optional[torch.Tensor] = None,
    budget: Optional[int] = None,
) -> None:
    """Target-verify replay metadata, bit-identical to SGLang's ``fused_dsa_target_verify_metadata``.

    Each request's ``next_n`` expanded page-table rows are written from one read of its
    ``req_to_token`` row. ``budget`` as in :func:`fused_dsa_decode_metadata_bounded`.
    """
    launch = _verify_launch(locals())
    if launch is not None:
        _bounded_target_verify_metadata_kernel[launch.grid](**launch.arguments, **launch.options)


def _verify_launch(a: Mapping[str, Any]) -> Optional[Launch]:
    bs, next_n, width, ctx_lens = (
        a["bs"],
        a["next_n"],
        a["max_seqlen_k"],
        a["paged_mqa_ctx_lens_2d"],
    )
    if not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n must be a positive int, got {next_n!r}")
    rows = bs * next_n
    check_expanded(a, width, rows)
    if bs == 0:
        zero_cumsum_heads(a["cu_seqlens_k"], a["dsa_cu_seqlens_k"])
        return None
    device = a["req_to_token"].device
    tables = page_tables(
        a["page_table_1"], a["real_page_table"], rows, width, a["physical_page_size"], device
    )
    has_ctx_lens = ctx_lens is not None
    if has_ctx_lens:
        check_int32("paged_mqa_ctx_lens_2d", ctx_lens, device, ndim=2)
        if tuple(ctx_lens.shape) != (bs, next_n):
            raise ValueError(
                f"paged_mqa_ctx_lens_2d must have shape (bs, next_n) = ({bs}, {next_n}), "
                f"got {tuple(ctx_lens.shape)}"
            )
    return bounded_launch(
        a,
        width,
        tables,
        **{name: a[name] for name in EXPANDED_OUTPUTS},
        paged_mqa_ctx_lens_2d=ctx_lens if has_ctx_lens else a["cache_seqlens"],
        ctx_lens_stride_0=ctx_lens.stride(0) if has_ctx_lens else 0,
        ctx_lens_stride_1=ctx_lens.stride(1) if has_ctx_lens else 0,
        next_n=next_n,
        HAS_CTX_LENS_2D=has_ctx_lens,
        BLOCK_EXPANDED=next_power_of_2(rows),
    )


_VERIFY = Binder(
    "target verify",
    _bounded_target_verify_metadata_kernel,
    2,
    _verify_launch,
    fused_dsa_target_verify_metadata_bounded,
)


# ----------------------------------------------------------------------------------------------
# Draft extend
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "total_len",
        "width",
        "num_programs",
        "page_table_stride_0",
        "real_page_table_stride_0",
    ],
    do_not_specialize_on_alignment=["seq_lens", "extend_seq_lens", "req_pool_indices"],
)
def _bounded_draft_extend_metadata_kernel(
    seq_lens,
    extend_seq_lens,
    req_pool_indices,
    req_to_token,
    cache_seqlens,
    cu_seqlens_k,
    page_table_1,
    seqlens_expanded,
    dsa_cache_seqlens,
    dsa_cu_seqlens_k,
    real_page_table,
    seq_lens_stride,
    extend_seq_lens_stride,
    req_pool_indices_stride,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    bs,
    total_len,
    width,
    num_programs,
    dsa_index_topk,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    STATIC_EXTEND_LEN: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_EXPANDED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid == 0:
        store_request_seqlens(
            seq_lens, seq_lens_stride, cache_seqlens, cu_seqlens_k, bs, 0, BLOCK_BS
        )
        offs_e = tl.arange(0, BLOCK_EXPANDED)
        mask_e = offs_e < total_len
        if STATIC_EXTEND_LEN:
            qo_len = tl.load(extend_seq_lens).to(tl.int32)
            req_of_e = offs_e // qo_len
            local_of_e = offs_e - req_of_e * qo_len
            qo_of_e = tl.full((BLOCK_EXPANDED,), 0, tl.int32) + qo_len
        else:
            # Rows past the last request's extend rows read request 0 with qo_len 1.
            req_of_e = tl.full((BLOCK_EXPANDED,), 0, tl.int32)
            local_of_e = tl.full((BLOCK_EXPANDED,), 0, tl.int32)
            qo_of_e = tl.full((BLOCK_EXPANDED,), 1, tl.int32)
            start = tl.full((), 0, tl.int32)
            for i in tl.range(0, bs):
                qo_len = tl.load(extend_seq_lens + i * extend_seq_lens_stride).to(tl.int32)
                inside = (offs_e >= start) & (offs_e < start + qo_len)
                req_of_e = tl.where(inside, i, req_of_e)
                local_of_e = tl.where(inside, offs_e - start, local_of_e)
                qo_of_e = tl.where(inside, qo_len, qo_of_e)
                start += qo_len
        base = tl.load(seq_lens + req_of_e * seq_lens_stride, mask=mask_e, other=0).to(tl.int32)
        # Padded graph rows (seq_len 1 < qo_len) clamp to 0, as SGLang does.
        expanded = tl.maximum(base - qo_of_e + local_of_e + 1, 0)
        store_expanded_seqlens(
            seqlens_expanded,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            expanded,
            mask_e,
            dsa_index_topk,
        )
        return

    copy_live_tiles(
        req_to_token=req_to_token,
        page_tables=(page_table_1,),
        real_page_tables=(real_page_table,),
        seq_lens=seq_lens,
        req_pool_indices=req_pool_indices,
        extend_seq_lens=extend_seq_lens,
        program=pid - 1,
        num_programs=num_programs,
        bs=bs,
        width=width,
        total_len=total_len,
        seq_lens_stride=seq_lens_stride,
        req_pool_indices_stride=req_pool_indices_stride,
        extend_seq_lens_stride=extend_seq_lens_stride,
        req_to_token_stride_0=req_to_token_stride_0,
        req_to_token_stride_1=req_to_token_stride_1,
        page_table_stride_0=page_table_stride_0,
        page_table_stride_1=page_table_stride_1,
        real_page_table_stride_0=real_page_table_stride_0,
        real_page_table_stride_1=real_page_table_stride_1,
        KV_ADD=0,
        ROWS_PER_REQUEST=0,  # each request's extend_seq_lens rows
        STATIC_EXTEND_LEN=STATIC_EXTEND_LEN,
        BLOCK_ROWS=BLOCK_ROWS,
        physical_page_size=physical_page_size,
        HAS_PAGE_TABLE_1=HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE=HAS_REAL_PAGE_TABLE,
        BLOCK_BS=BLOCK_BS,
        BLOCK_N=BLOCK_N,
        TILE_N=TILE_N,
        NUM_STAGES=NUM_STAGES,
    )


def fused_dsa_draft_extend_metadata_bounded(
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table_1: Optional[torch.Tensor],
    seqlens_expanded: torch.Tensor,
    dsa_cache_seqlens: torch.Tensor,
    dsa_cu_seqlens_k: torch.Tensor,
    real_page_table: Optional[torch.Tensor],
    bs: int,
    total_len: int,
    max_seqlen_k: int,
    dsa_index_topk: int,
    physical_page_size: int,
    max_extend_len: int,
    max_total_len: int,
    static_extend_len: bool = False,
    budget: Optional[int] = None,
) -> None:
    """Draft-extend replay metadata, bit-identical to SGLang's ``fused_dsa_draft_extend_metadata``.

    Each request's ``extend_seq_lens[r]`` page-table rows (at most ``next_power_of_2(max_extend_len)``,
    as in SGLang) are written from one read of its ``req_to_token`` row.
    """
    launch = _draft_extend_launch(locals())
    if launch is not None:
        _bounded_draft_extend_metadata_kernel[launch.grid](**launch.arguments, **launch.options)


def _draft_extend_launch(a: Mapping[str, Any]) -> Optional[Launch]:
    bs, total_len, width = a["bs"], a["total_len"], a["max_seqlen_k"]
    max_extend_len, max_total_len = a["max_extend_len"], a["max_total_len"]
    check_expanded(a, width, total_len, extend_seq_lens=(a["extend_seq_lens"], bs))
    if bs == 0:
        zero_cumsum_heads(a["cu_seqlens_k"], a["dsa_cu_seqlens_k"])
        return None
    if total_len == 0:
        lengths = a["seq_lens"].to(torch.int32)
        a["cache_seqlens"][:bs].copy_(lengths[:bs])
        a["cu_seqlens_k"][1 : bs + 1].copy_(torch.cumsum(lengths, dim=0, dtype=torch.int32))
        zero_cumsum_heads(a["cu_seqlens_k"], a["dsa_cu_seqlens_k"])
        return None
    if max_extend_len < 1:
        raise ValueError(f"max_extend_len must be >= 1, got {max_extend_len}")
    if not total_len <= min(max_total_len, bs * max_extend_len):
        raise ValueError(
            f"total_len ({total_len}) must be <= max_total_len ({max_total_len}) "
            f"and <= bs * max_extend_len ({bs * max_extend_len})"
        )
    tables = page_tables(
        a["page_table_1"],
        a["real_page_table"],
        total_len,
        width,
        a["physical_page_size"],
        a["req_to_token"].device,
    )
    many = bs >= DRAFT_EXTEND_MANY_REQUESTS
    return bounded_launch(
        a,
        width,
        tables,
        num_warps=DRAFT_EXTEND_MANY_WARPS if many else None,
        extend_seq_lens=a["extend_seq_lens"],
        **{name: a[name] for name in EXPANDED_OUTPUTS},
        extend_seq_lens_stride=a["extend_seq_lens"].stride(0),
        total_len=total_len,
        STATIC_EXTEND_LEN=bool(a["static_extend_len"]),
        BLOCK_EXPANDED=next_power_of_2(max_total_len),
        BLOCK_ROWS=next_power_of_2(max_extend_len),
    )


_DRAFT_EXTEND = Binder(
    "draft extend",
    _bounded_draft_extend_metadata_kernel,
    3,
    _draft_extend_launch,
    fused_dsa_draft_extend_metadata_bounded,
)
