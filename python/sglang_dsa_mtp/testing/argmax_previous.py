"""The argmax partials kernel as it was before its programs looped over column steps: one program
per (row, split), one masked load of ``SPLIT_N`` columns each. Kept for the verify-pick benchmark's
before/after table only (``--variant previous``); the plugin ships the looped kernel.

It writes the same exchange buffer as the shipped kernel (every candidate in its own split's slot),
from the shipped kernel's own key, lane and store helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_dsa_mtp.kernels.ops.host import next_power_of_2
from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap

PARTIALS_NUM_WARPS = 4


@triton.jit(do_not_specialize=["tp_rank", "col_base", "valid_width"])
def _previous_partials_kernel(
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
    NEG_1E30_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TP: tl.constexpr,
    LANES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = split * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < valid_width
    vals = tl.load(logits + row * logits_stride_0 + offs * logits_stride_1, mask=valid, other=0.0)
    packed, nan_cols = dap._masked_keys(vals, offs, valid, NEG_1E30_BITS)
    packed, first_nan = tl.reduce((packed, nan_cols), 0, dap._max_and_min)
    key_hi, key_lo, index, nan_lane = dap._candidate_lanes(packed, first_nan, col_base, valid_width)
    dap._store_slots(
        out + row * out_stride_0,
        out_stride_1,
        split,
        1,
        key_hi,
        key_lo,
        index,
        nan_lane,
        tp_rank,
        tp_size,
        splits,
        BLOCK_TP,
        LANES,
    )


def launch_previous_partials(
    layout: dap.PartialsLayout, logits_shard: torch.Tensor
) -> torch.Tensor:
    """:func:`dap.launch_partials` through the previous kernel: a ``(rows, splits)`` grid."""
    rows = logits_shard.shape[0]
    shape = dap.exchange_shape(rows, layout.shard_width, layout.tp_size)
    out = torch.empty(shape, dtype=torch.float32, device=logits_shard.device)
    if rows == 0:
        return out
    _previous_partials_kernel[(rows, layout.splits)](
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
        NEG_1E30_BITS=dap._NEG_1E30_BITS,
        BLOCK_N=dap.SPLIT_N,
        BLOCK_TP=next_power_of_2(layout.tp_size),
        LANES=dap.LANES,
        num_warps=PARTIALS_NUM_WARPS,
    )
    return out
