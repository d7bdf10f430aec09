"""Bounded DSA replay-metadata kernels: decode, target verify and draft extend.

Drop-in variants of ``fused_dsa_decode_metadata``, ``fused_dsa_target_verify_metadata`` and
``fused_dsa_draft_extend_metadata`` (``sglang/kernels/ops/attention/dsa/metadata.py``, SGLang 0.5.23):
the same keyword arguments and outputs, bit for bit, plus ``budget``.

SGLang's kernels launch one program per (row, 128-column block) of the context-wide page table, so a
1M-token table costs ``1 + rows * 8193`` programs per replay whatever the live KV length. Here the
launch is ``1 + requests * splits`` programs with

    splits = max(1, min(budget // requests, MAX_SPLITS_PER_REQUEST, cdiv(width, TILE_N)))

Program 0 writes the per-request / per-row length vectors; each other program strides over its
request's live tiles (``TILE_N`` columns, a multiple of SGLang's 128-column block) and writes the
request's page-table rows (all ``next_n`` verify rows, all draft-extend rows of the request) from one
read of ``req_to_token``. The grid depends only on (requests, width, budget), never on the live lengths,
so one CUDA-graph capture serves every later replay.

Write region (SGLang's contract, reproduced exactly): per output row, page-table columns
``c < min(width, 128 * cdiv(kv_len, 128))``, i.e. whole live 128-column blocks masked by the width;
``real_page_table`` gets ``req_to_token // page_size`` at every page-start column of that region.
Everything else, including rows past the live batch, keeps its old contents.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_dsa_mtp.kernels.ops.host import cdiv, next_power_of_2
from sglang_dsa_mtp.kernels.ops.launch import LaunchPlans, specialization_twin

BLOCK_N = 128  # SGLang's column block: the write region is whole blocks of this many columns
TILE_N = 256  # columns one program moves per loop iteration (a multiple of BLOCK_N)
MAX_SPLITS_PER_REQUEST = 256
NUM_WARPS = 4
NUM_STAGES = 3  # software-pipelined tile loads in each program's strided loop
PROGRAMS_PER_SM = 8  # default budget on CUDA: this many page-table programs per multiprocessor
CPU_DEFAULT_BUDGET = 64  # default budget for CPU tensors (Triton interpreter)


def default_budget(device: torch.device) -> int:
    """The page-table program budget used when ``budget=None``."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return PROGRAMS_PER_SM * _multiprocessor_count(index)
    return CPU_DEFAULT_BUDGET


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tuning() -> tuple:
    """The module constants a launch depends on (benchmarks and tests override them): part of
    every launch plan's key."""
    return BLOCK_N, TILE_N, NUM_STAGES, NUM_WARPS, MAX_SPLITS_PER_REQUEST, PROGRAMS_PER_SM


def bounded_num_splits(requests: int, width: int, budget: int) -> int:
    """Programs per request: depends only on (requests, width, budget), never on live lengths."""
    num_tiles = cdiv(width, TILE_N)
    return max(1, min(budget // requests, MAX_SPLITS_PER_REQUEST, num_tiles))


# ----------------------------------------------------------------------------------------------
# Shared device code
# ----------------------------------------------------------------------------------------------


@triton.jit
def _copy_live_tiles(
    req_to_token,
    page_table_1,
    real_page_table,
    req_idx,
    kv_len,
    first_row,
    num_rows,
    split,
    num_splits,
    width,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Copy this program's share of one request's live tiles into rows first_row .. +num_rows."""
    _copy_live_tiles_multi(
        req_to_token,
        page_table_1,
        real_page_table,
        page_table_1,
        real_page_table,
        page_table_1,
        real_page_table,
        page_table_1,
        real_page_table,
        req_idx,
        kv_len,
        first_row,
        num_rows,
        split,
        num_splits,
        width,
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
        physical_page_size,
        HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE,
        BLOCK_N,
        TILE_N,
        NUM_STAGES,
        1,
    )


@triton.jit
def _copy_live_tiles_multi(
    req_to_token,
    page_table_1_0,
    real_page_table_0,
    page_table_1_1,
    real_page_table_1,
    page_table_1_2,
    real_page_table_2,
    page_table_1_3,
    real_page_table_3,
    req_idx,
    kv_len,
    first_row,
    num_rows,
    split,
    num_splits,
    width,
    req_to_token_stride_0,
    req_to_token_stride_1,
    page_table_stride_0,
    page_table_stride_1,
    real_page_table_stride_0,
    real_page_table_stride_1,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NUM_DEST: tl.constexpr,
):
    """:func:`_copy_live_tiles` into the first ``NUM_DEST`` (1 to 4) destinations' tables, which
    share their strides: each live tile is read once and stored to every destination."""
    # Whole live 128-column blocks, the last one masked by the width: SGLang's write region.
    live_end = tl.minimum(tl.cdiv(kv_len, BLOCK_N) * BLOCK_N, width)
    num_tiles = tl.cdiv(live_end, TILE_N)
    src = req_to_token + req_idx.to(tl.int64) * req_to_token_stride_0
    first_row = first_row.to(tl.int64)
    for tile in tl.range(split, num_tiles, num_splits, num_stages=NUM_STAGES):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        mask = offs_n < live_end
        vals = tl.load(src + offs_n * req_to_token_stride_1, mask=mask, other=0).to(tl.int32)
        # page_table_1 offsets / values, then real_page_table's (one entry per page start).
        offs = offs_n * page_table_stride_1
        real_offs = (offs_n // physical_page_size) * real_page_table_stride_1
        real_vals = vals // physical_page_size
        real_mask = mask & ((offs_n % physical_page_size) == 0)
        for r in range(num_rows):
            row = first_row + r
            offs_row = row * page_table_stride_0 + offs
            real_offs_row = row * real_page_table_stride_0 + real_offs
            _store_tile(
                page_table_1_0,
                real_page_table_0,
                offs_row,
                real_offs_row,
                vals,
                real_vals,
                mask,
                real_mask,
                HAS_PAGE_TABLE_1,
                HAS_REAL_PAGE_TABLE,
            )
            if NUM_DEST > 1:
                _store_tile(
                    page_table_1_1,
                    real_page_table_1,
                    offs_row,
                    real_offs_row,
                    vals,
                    real_vals,
                    mask,
                    real_mask,
                    HAS_PAGE_TABLE_1,
                    HAS_REAL_PAGE_TABLE,
                )
            if NUM_DEST > 2:
                _store_tile(
                    page_table_1_2,
                    real_page_table_2,
                    offs_row,
                    real_offs_row,
                    vals,
                    real_vals,
                    mask,
                    real_mask,
                    HAS_PAGE_TABLE_1,
                    HAS_REAL_PAGE_TABLE,
                )
            if NUM_DEST > 3:
                _store_tile(
                    page_table_1_3,
                    real_page_table_3,
                    offs_row,
                    real_offs_row,
                    vals,
                    real_vals,
                    mask,
                    real_mask,
                    HAS_PAGE_TABLE_1,
                    HAS_REAL_PAGE_TABLE,
                )


@triton.jit
def _store_tile(
    page_table_1,
    real_page_table,
    offs,
    real_offs,
    vals,
    real_vals,
    mask,
    real_mask,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
):
    """One destination's share of a tile: page_table_1 columns and real_page_table page starts."""
    if HAS_PAGE_TABLE_1:
        tl.store(page_table_1 + offs, vals, mask=mask)
    if HAS_REAL_PAGE_TABLE:
        tl.store(real_page_table + real_offs, real_vals, mask=real_mask)


@triton.jit
def _store_cumsum_from_zero(cu, values, mask):
    """cu[0] = 0, cu[1 + i] = values[0] + ... + values[i] for the masked-in lanes."""
    tl.store(cu, tl.full((), 0, tl.int32))
    tl.store(cu + 1 + tl.arange(0, values.shape[0]), tl.cumsum(values, 0), mask=mask)


@triton.jit
def _store_request_seqlens(
    seq_lens, seq_lens_stride, cache_seqlens, cu_seqlens_k, bs, add, BLOCK_BS: tl.constexpr
):
    """cache_seqlens[b] = seq_lens[b] + add and its zero-led cumsum; returns the loaded lengths."""
    offs_b = tl.arange(0, BLOCK_BS)
    mask_b = offs_b < bs
    seq = tl.load(seq_lens + offs_b * seq_lens_stride, mask=mask_b, other=0).to(tl.int32)
    tl.store(cache_seqlens + offs_b, seq + add, mask=mask_b)
    _store_cumsum_from_zero(cu_seqlens_k, seq + add, mask_b)
    return seq


@triton.jit
def _store_decode_seqlens(
    seq, mask_b, cache_seqlens, cu_seqlens_k, dsa_cache_seqlens, dsa_cu_seqlens_k, dsa_index_topk
):
    """Decode's length vectors from the loaded per-request lengths ``seq``."""
    offs_b = tl.arange(0, seq.shape[0])
    tl.store(cache_seqlens + offs_b, seq, mask=mask_b)
    _store_cumsum_from_zero(cu_seqlens_k, seq, mask_b)
    dsa_seq = tl.minimum(seq, dsa_index_topk)
    tl.store(dsa_cache_seqlens + offs_b, dsa_seq, mask=mask_b)
    _store_cumsum_from_zero(dsa_cu_seqlens_k, dsa_seq, mask_b)


@triton.jit
def _store_expanded_seqlens(
    seqlens_expanded, dsa_cache_seqlens, dsa_cu_seqlens_k, expanded_seq, mask_e, dsa_index_topk
):
    expanded_seq = tl.where(mask_e, expanded_seq, 0)
    dsa_seq = tl.minimum(expanded_seq, dsa_index_topk)
    offs_e = tl.arange(0, expanded_seq.shape[0])
    tl.store(seqlens_expanded + offs_e, expanded_seq, mask=mask_e)
    tl.store(dsa_cache_seqlens + offs_e, dsa_seq, mask=mask_e)
    _store_cumsum_from_zero(dsa_cu_seqlens_k, dsa_seq, mask_e)


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "width",
        "num_splits",
        "page_table_stride_0",
        "real_page_table_stride_0",
    ],
    do_not_specialize_on_alignment=["seq_lens", "req_pool_indices"],
)
def _bounded_decode_metadata_kernel(
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
    num_splits,
    dsa_index_topk,
    physical_page_size: tl.constexpr,
    HAS_PAGE_TABLE_1: tl.constexpr,
    HAS_REAL_PAGE_TABLE: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid == 0:
        offs_b = tl.arange(0, BLOCK_BS)
        mask_b = offs_b < bs
        seq = tl.load(seq_lens + offs_b * seq_lens_stride, mask=mask_b, other=0).to(tl.int32)
        _store_decode_seqlens(
            seq,
            mask_b,
            cache_seqlens,
            cu_seqlens_k,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            dsa_index_topk,
        )
        return

    req = (pid - 1) // num_splits
    split = (pid - 1) - req * num_splits
    req_idx = tl.load(req_pool_indices + req * req_pool_indices_stride)
    kv_len = tl.load(seq_lens + req * seq_lens_stride).to(tl.int32)
    _copy_live_tiles(
        req_to_token,
        page_table_1,
        real_page_table,
        req_idx,
        kv_len,
        req,
        1,
        split,
        num_splits,
        width,
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
        physical_page_size,
        HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE,
        BLOCK_N,
        TILE_N,
        NUM_STAGES,
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

    ``budget``: the most page-table programs one launch may use (at least one per request);
    None uses :func:`default_budget`. ``page_table_1=None`` is allowed when
    ``physical_page_size > 1`` (only ``real_page_table`` is written); with page size 1
    ``real_page_table`` is ``page_table_1``.
    """
    key = (
        bs,
        max_len,
        dsa_index_topk,
        physical_page_size,
        budget,
        tuning(),
        id(req_to_token),
        id(cache_seqlens),
        id(cu_seqlens_k),
        id(page_table_1),
        id(dsa_cache_seqlens),
        id(dsa_cu_seqlens_k),
        id(real_page_table),
    )
    if _DECODE_PLANS.launch_cached(key, (seq_lens, req_pool_indices)):
        return
    _check_common(
        seq_lens,
        req_pool_indices,
        req_to_token,
        bs,
        max_len,
        physical_page_size,
        budget,
        cache_seqlens=(cache_seqlens, bs),
        cu_seqlens_k=(cu_seqlens_k, bs + 1),
        dsa_cache_seqlens=(dsa_cache_seqlens, bs),
        dsa_cu_seqlens_k=(dsa_cu_seqlens_k, bs + 1),
    )
    if bs == 0:
        cu_seqlens_k[:1].zero_()
        dsa_cu_seqlens_k[:1].zero_()
        return
    page_table_1, real_page_table, has_pt1, has_real = _page_tables(
        page_table_1, real_page_table, bs, max_len, physical_page_size, req_to_token.device
    )
    budget = default_budget(seq_lens.device) if budget is None else budget
    num_splits = bounded_num_splits(bs, max_len, budget)
    _DECODE_PLANS.launch(
        key,
        (1 + bs * num_splits,),
        (
            seq_lens,
            req_pool_indices,
            req_to_token,
            cache_seqlens,
            cu_seqlens_k,
            page_table_1,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            real_page_table,
            seq_lens.stride(0),
            req_pool_indices.stride(0),
            req_to_token.stride(0),
            req_to_token.stride(1),
            page_table_1.stride(0),
            page_table_1.stride(1),
            real_page_table.stride(0),
            real_page_table.stride(1),
            bs,
            max_len,
            num_splits,
            dsa_index_topk,
            physical_page_size,
            has_pt1,
            has_real,
        ),
        dict(BLOCK_BS=next_power_of_2(bs), BLOCK_N=BLOCK_N, TILE_N=TILE_N, NUM_STAGES=NUM_STAGES),
        input_len=bs,
        num_warps=NUM_WARPS,
    )


_DECODE_PLANS = LaunchPlans(_bounded_decode_metadata_kernel, num_inputs=2)


# ----------------------------------------------------------------------------------------------
# Target verify
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "width",
        "num_splits",
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
    num_splits,
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
        _store_request_seqlens(
            seq_lens, seq_lens_stride, cache_seqlens, cu_seqlens_k, bs, next_n, BLOCK_BS
        )
        offs_e = tl.arange(0, BLOCK_EXPANDED)
        mask_e = offs_e < bs * next_n
        req_of_e = offs_e // next_n
        draft_of_e = offs_e - req_of_e * next_n
        base = tl.load(seq_lens + req_of_e * seq_lens_stride, mask=mask_e, other=0).to(tl.int32)
        _store_expanded_seqlens(
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

    req = (pid - 1) // num_splits
    split = (pid - 1) - req * num_splits
    req_idx = tl.load(req_pool_indices + req * req_pool_indices_stride)
    kv_len = tl.load(seq_lens + req * seq_lens_stride).to(tl.int32) + next_n
    _copy_live_tiles(
        req_to_token,
        page_table_1,
        real_page_table,
        req_idx,
        kv_len,
        req * next_n,
        next_n,
        split,
        num_splits,
        width,
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
        physical_page_size,
        HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE,
        BLOCK_N,
        TILE_N,
        NUM_STAGES,
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
    key = (
        bs,
        max_seqlen_k,
        dsa_index_topk,
        physical_page_size,
        next_n,
        budget,
        tuning(),
        id(req_to_token),
        id(cache_seqlens),
        id(cu_seqlens_k),
        id(page_table_1),
        id(seqlens_expanded),
        id(dsa_cache_seqlens),
        id(dsa_cu_seqlens_k),
        id(real_page_table),
        id(paged_mqa_ctx_lens_2d),
    )
    if _VERIFY_PLANS.launch_cached(key, (seq_lens, req_pool_indices)):
        return
    rows = bs * next_n
    _check_common(
        seq_lens,
        req_pool_indices,
        req_to_token,
        bs,
        max_seqlen_k,
        physical_page_size,
        budget,
        cache_seqlens=(cache_seqlens, bs),
        cu_seqlens_k=(cu_seqlens_k, bs + 1),
        seqlens_expanded=(seqlens_expanded, rows),
        dsa_cache_seqlens=(dsa_cache_seqlens, rows),
        dsa_cu_seqlens_k=(dsa_cu_seqlens_k, rows + 1),
    )
    if bs == 0:
        cu_seqlens_k[:1].zero_()
        dsa_cu_seqlens_k[:1].zero_()
        return
    if not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n must be a positive int, got {next_n!r}")
    page_table_1, real_page_table, has_pt1, has_real = _page_tables(
        page_table_1,
        real_page_table,
        rows,
        max_seqlen_k,
        physical_page_size,
        req_to_token.device,
    )
    has_ctx_lens = paged_mqa_ctx_lens_2d is not None
    if has_ctx_lens:
        _check_int32("paged_mqa_ctx_lens_2d", paged_mqa_ctx_lens_2d, req_to_token.device, ndim=2)
        if tuple(paged_mqa_ctx_lens_2d.shape) != (bs, next_n):
            raise ValueError(
                f"paged_mqa_ctx_lens_2d must have shape (bs, next_n) = ({bs}, {next_n}), "
                f"got {tuple(paged_mqa_ctx_lens_2d.shape)}"
            )
    ctx_lens = paged_mqa_ctx_lens_2d if has_ctx_lens else cache_seqlens
    budget = default_budget(seq_lens.device) if budget is None else budget
    num_splits = bounded_num_splits(bs, max_seqlen_k, budget)
    _VERIFY_PLANS.launch(
        key,
        (1 + bs * num_splits,),
        (
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
            ctx_lens,
            seq_lens.stride(0),
            req_pool_indices.stride(0),
            req_to_token.stride(0),
            req_to_token.stride(1),
            page_table_1.stride(0),
            page_table_1.stride(1),
            real_page_table.stride(0),
            real_page_table.stride(1),
            paged_mqa_ctx_lens_2d.stride(0) if has_ctx_lens else 0,
            paged_mqa_ctx_lens_2d.stride(1) if has_ctx_lens else 0,
            bs,
            max_seqlen_k,
            num_splits,
            dsa_index_topk,
            next_n,
            physical_page_size,
            has_pt1,
            has_real,
            has_ctx_lens,
        ),
        dict(
            BLOCK_BS=next_power_of_2(bs),
            BLOCK_EXPANDED=next_power_of_2(rows),
            BLOCK_N=BLOCK_N,
            TILE_N=TILE_N,
            NUM_STAGES=NUM_STAGES,
        ),
        input_len=bs,
        num_warps=NUM_WARPS,
    )


_VERIFY_PLANS = LaunchPlans(_bounded_target_verify_metadata_kernel, num_inputs=2)


# ----------------------------------------------------------------------------------------------
# Draft extend
# ----------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "bs",
        "total_len",
        "width",
        "num_splits",
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
    num_splits,
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
        _store_request_seqlens(
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
        _store_expanded_seqlens(
            seqlens_expanded,
            dsa_cache_seqlens,
            dsa_cu_seqlens_k,
            expanded,
            mask_e,
            dsa_index_topk,
        )
        return

    req = (pid - 1) // num_splits
    split = (pid - 1) - req * num_splits
    qo_len = tl.load(extend_seq_lens + req * extend_seq_lens_stride).to(tl.int32)
    if STATIC_EXTEND_LEN:
        first_row = req * qo_len
    else:
        first_row = tl.full((), 0, tl.int32)
        for i in tl.range(0, req):
            first_row += tl.load(extend_seq_lens + i * extend_seq_lens_stride).to(tl.int32)
    req_idx = tl.load(req_pool_indices + req * req_pool_indices_stride)
    kv_len = tl.load(seq_lens + req * seq_lens_stride).to(tl.int32)
    # SGLang writes at most BLOCK_ROWS (next_power_of_2(max_extend_len)) rows per request.
    num_rows = tl.maximum(tl.minimum(tl.minimum(qo_len, BLOCK_ROWS), total_len - first_row), 0)
    _copy_live_tiles(
        req_to_token,
        page_table_1,
        real_page_table,
        req_idx,
        kv_len,
        first_row,
        num_rows,
        split,
        num_splits,
        width,
        req_to_token_stride_0,
        req_to_token_stride_1,
        page_table_stride_0,
        page_table_stride_1,
        real_page_table_stride_0,
        real_page_table_stride_1,
        physical_page_size,
        HAS_PAGE_TABLE_1,
        HAS_REAL_PAGE_TABLE,
        BLOCK_N,
        TILE_N,
        NUM_STAGES,
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
    key = (
        bs,
        total_len,
        max_seqlen_k,
        dsa_index_topk,
        physical_page_size,
        max_extend_len,
        max_total_len,
        static_extend_len,
        budget,
        tuning(),
        id(req_to_token),
        id(cache_seqlens),
        id(cu_seqlens_k),
        id(page_table_1),
        id(seqlens_expanded),
        id(dsa_cache_seqlens),
        id(dsa_cu_seqlens_k),
        id(real_page_table),
    )
    if _DRAFT_EXTEND_PLANS.launch_cached(key, (seq_lens, extend_seq_lens, req_pool_indices)):
        return
    _check_common(
        seq_lens,
        req_pool_indices,
        req_to_token,
        bs,
        max_seqlen_k,
        physical_page_size,
        budget,
        extend_seq_lens=(extend_seq_lens, bs),
        cache_seqlens=(cache_seqlens, bs),
        cu_seqlens_k=(cu_seqlens_k, bs + 1),
        seqlens_expanded=(seqlens_expanded, total_len),
        dsa_cache_seqlens=(dsa_cache_seqlens, total_len),
        dsa_cu_seqlens_k=(dsa_cu_seqlens_k, total_len + 1),
    )
    if bs == 0:
        cu_seqlens_k[:1].zero_()
        dsa_cu_seqlens_k[:1].zero_()
        return
    if total_len == 0:
        lengths = seq_lens.to(torch.int32)
        cache_seqlens[:bs].copy_(lengths[:bs])
        cu_seqlens_k[:1].zero_()
        cu_seqlens_k[1 : bs + 1].copy_(torch.cumsum(lengths, dim=0, dtype=torch.int32))
        dsa_cu_seqlens_k[:1].zero_()
        return
    if max_extend_len < 1:
        raise ValueError(f"max_extend_len must be >= 1, got {max_extend_len}")
    if not total_len <= min(max_total_len, bs * max_extend_len):
        raise ValueError(
            f"total_len ({total_len}) must be <= max_total_len ({max_total_len}) "
            f"and <= bs * max_extend_len ({bs * max_extend_len})"
        )
    page_table_1, real_page_table, has_pt1, has_real = _page_tables(
        page_table_1,
        real_page_table,
        total_len,
        max_seqlen_k,
        physical_page_size,
        req_to_token.device,
    )
    budget = default_budget(seq_lens.device) if budget is None else budget
    num_splits = bounded_num_splits(bs, max_seqlen_k, budget)
    _DRAFT_EXTEND_PLANS.launch(
        key,
        (1 + bs * num_splits,),
        (
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
            seq_lens.stride(0),
            extend_seq_lens.stride(0),
            req_pool_indices.stride(0),
            req_to_token.stride(0),
            req_to_token.stride(1),
            page_table_1.stride(0),
            page_table_1.stride(1),
            real_page_table.stride(0),
            real_page_table.stride(1),
            bs,
            total_len,
            max_seqlen_k,
            num_splits,
            dsa_index_topk,
            physical_page_size,
            has_pt1,
            has_real,
            bool(static_extend_len),
        ),
        dict(
            BLOCK_BS=next_power_of_2(bs),
            BLOCK_EXPANDED=next_power_of_2(max_total_len),
            BLOCK_ROWS=next_power_of_2(max_extend_len),
            BLOCK_N=BLOCK_N,
            TILE_N=TILE_N,
            NUM_STAGES=NUM_STAGES,
        ),
        input_len=bs,
        num_warps=NUM_WARPS,
    )


_DRAFT_EXTEND_PLANS = LaunchPlans(_bounded_draft_extend_metadata_kernel, num_inputs=3)


# ----------------------------------------------------------------------------------------------
# Argument checks (host-only: no device synchronization on the replay path)
# ----------------------------------------------------------------------------------------------


def _check_int32(name, tensor, device, *, ndim):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (where req_to_token is)")


def _check_common(
    seq_lens, req_pool_indices, req_to_token, bs, width, page_size, budget, **outputs
):
    if not isinstance(req_to_token, torch.Tensor):
        raise TypeError(f"req_to_token must be a torch.Tensor, got {type(req_to_token).__name__}")
    device = req_to_token.device
    _check_int32("req_to_token", req_to_token, device, ndim=2)
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
            _check_int32(name, tensor, device, ndim=1)
        if tensor.shape[0] < needed:
            raise ValueError(f"{name} needs at least {needed} entries, got {tensor.shape[0]}")


def _page_tables(page_table_1, real_page_table, rows, width, page_size, device):
    """Validate the two page tables; return (page_table_1, real_page_table, has_pt1, has_real)
    with a stand-in tensor for a table that is not written (its pointer is never dereferenced)."""
    has_pt1 = page_table_1 is not None
    has_real = page_size > 1
    if not has_pt1 and not has_real:
        raise ValueError("page_table_1 is required when physical_page_size == 1")
    if has_pt1:
        _check_int32("page_table_1", page_table_1, device, ndim=2)
        if page_table_1.shape[0] < rows or page_table_1.shape[1] < width:
            raise ValueError(
                f"page_table_1 must be at least ({rows}, {width}), got {tuple(page_table_1.shape)}"
            )
    if has_real:
        if real_page_table is None:
            raise ValueError("real_page_table is required when physical_page_size > 1")
        _check_int32("real_page_table", real_page_table, device, ndim=2)
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


# ----------------------------------------------------------------------------------------------
# Warm-up: compile a call's kernel variant ahead of the call
# ----------------------------------------------------------------------------------------------

_TABLES = ("page_table_1", "real_page_table")  # context-wide tables: twins share one row


def warm_up(wrapper, **kwargs) -> None:
    """Compile (or find in Triton's cache) the kernel variant that ``wrapper(**kwargs)`` launches,
    without touching any buffer of ``kwargs``.

    ``wrapper`` is one of this module's three wrappers or
    ``dsa_draft_decode_metadata.fused_dsa_draft_decode_metadata_multi``; ``kwargs`` are the keyword
    arguments of the real call. The call is made on :func:`specialization_twin` copies of every buffer
    (a ``destinations`` list is twinned field by field), with every request at length 0 in slot 0;
    ``extend_seq_lens`` keeps its values. ``req_to_token`` itself is passed (read-only): the kernels
    then read at most its first 128-column block of slot 0. Triton specializes on the twins as on the
    buffers, so the real call finds its kernel compiled. Must not run while a CUDA graph is captured
    (the launch would join the graph).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("warm_up launches a kernel: call it outside CUDA-graph capture")
    wrapper(**{name: _twin(name, value) for name, value in kwargs.items()})


def _twin(name: str, value):
    if name == "req_to_token" or not isinstance(value, (torch.Tensor, list, tuple)):
        return value
    if isinstance(value, (list, tuple)):  # MTP destinations: twin each buffer of each NamedTuple
        return [
            dest._replace(**{field: _twin(field, getattr(dest, field)) for field in dest._fields})
            for dest in value
        ]
    twin = specialization_twin(value, shared_rows=name in _TABLES)
    if name == "extend_seq_lens":
        twin.copy_(value)
    return twin
