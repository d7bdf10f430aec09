"""Chunked paged-MQA logits gathered into one output, live columns only.

Where SGLang 0.5.23's DSA indexer (``Indexer._get_topk_paged``) joins the chunks of more rows than
the SM count with a full-width ``torch.cat``, :func:`chunked_paged_mqa_logits_live` computes the
same chunks (same logits function, same schedules) and :func:`copy_live_logits` copies only each
chunk's live columns into one contiguous ``[rows, max_len]`` fp32 output. Live columns of a row:
``[0, min(max_len, 64 * cdiv(length, 64)))``, ``length`` its context length, read on the device;
they cover all the top-k reads, the rest is left unwritten. The copy's grid never depends on the
lengths (one CUDA-graph capture serves every replay); its one variant per device is compiled by
:func:`warm_up`, and the wrapper accepts only that variant's arguments. Details:
docs/indexer-cliff.md, section "What the plugin changes".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_dsa_mtp.kernels.ops.host import cdiv, default_budget

LIVE_BLOCK = 64  # live columns are whole KV blocks of this many tokens (DeepGEMM's BLOCK_KV)
TILE_N = 1024  # columns one program moves per loop iteration
MAX_SPLITS_PER_ROW = 64
NUM_WARPS = 4
NUM_STAGES = 2
ALIGN = 16  # elements: row strides and the width must be multiples (one compiled variant)
PROGRAMS_PER_SM = 8  # the copy's default budget on CUDA, per multiprocessor

_warm_devices: set[int] = set()


def live_num_splits(rows: int, width: int, budget: int) -> int:
    """Programs per row: depends only on (rows, width, budget), never on the live lengths."""
    return max(1, min(budget // rows, MAX_SPLITS_PER_ROW, cdiv(width, TILE_N)))


@triton.jit(do_not_specialize=["lengths", "lengths_stride", "row_start", "num_splits"])
def _copy_live_logits_kernel(
    src,
    dst,
    lengths,
    src_stride,
    dst_stride,
    lengths_stride,
    width,
    row_start,
    num_splits,
    LIVE_BLOCK: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // num_splits
    split = pid - row * num_splits
    out_row = row_start + row
    length = tl.load(lengths + out_row.to(tl.int64) * lengths_stride)
    length = tl.minimum(tl.maximum(length, 0), width)
    # Whole live KV blocks, the last one masked by the width.
    live_end = tl.minimum(tl.cdiv(length, LIVE_BLOCK) * LIVE_BLOCK, width)
    src_row = src + row.to(tl.int64) * src_stride
    dst_row = dst + out_row.to(tl.int64) * dst_stride
    for tile in tl.range(split, tl.cdiv(live_end, TILE_N), num_splits, num_stages=NUM_STAGES):
        offs = tile * TILE_N + tl.arange(0, TILE_N)
        mask = offs < live_end
        tl.store(dst_row + offs, tl.load(src_row + offs, mask=mask), mask=mask)


def copy_live_logits(
    src: torch.Tensor,
    dst: torch.Tensor,
    lengths: torch.Tensor,
    *,
    row_start: int = 0,
    budget: Optional[int] = None,
) -> None:
    """``dst[row_start + r, c] = src[r, c]`` for every row ``r`` of ``src`` and every live column
    ``c < min(width, 64 * cdiv(lengths[row_start + r], 64))``; nothing else of ``dst`` is written.

    ``src``: ``[rows, width]`` fp32 logits (unit column stride; the row stride may exceed the width,
    as in DeepGEMM's padded output). ``dst``: ``[>= row_start + rows, width]`` fp32. ``lengths``: int32,
    ``[>= row_start + rows]`` or ``[>= row_start + rows, 1]``, read on the device (negative counts as
    0, past the width as the width). ``budget``: the most programs one launch may use (at least one
    per row); None uses ``PROGRAMS_PER_SM`` per SM (64 on the CPU).
    """
    for name, tensor in (("src", src), ("dst", dst)):
        mismatch = _layout_mismatch(name, tensor)
        if mismatch is not None:
            raise mismatch
    rows, width = src.shape
    if src.device != dst.device:
        raise ValueError(f"src and dst must be on one device, got {src.device}, {dst.device}")
    if dst.shape[1] != width:
        raise ValueError(f"dst must be {width} columns wide like src, got {tuple(dst.shape)}")
    _check_destination(dst, lengths, row_start, rows, budget)
    _launch_copy(src, dst, lengths, row_start, budget)


def _launch_copy(src, dst, lengths, row_start, budget) -> None:
    rows, width = src.shape
    if rows == 0 or width == 0:
        return
    budget = default_budget(src.device, PROGRAMS_PER_SM) if budget is None else budget
    num_splits = live_num_splits(rows, width, budget)
    _copy_live_logits_kernel[(rows * num_splits,)](
        src,
        dst,
        lengths,
        _row_stride(src),
        _row_stride(dst),
        lengths.stride(0),
        width,
        row_start,
        num_splits,
        LIVE_BLOCK=LIVE_BLOCK,
        TILE_N=TILE_N,
        NUM_STAGES=NUM_STAGES,
        num_warps=NUM_WARPS,
    )


def chunked_paged_mqa_logits_live(
    logits_fn: Callable[..., torch.Tensor],
    schedule_fn: Callable[[torch.Tensor, int, int], torch.Tensor],
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    *,
    chunk_rows: int,
    block_kv: int,
    budget: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    on_whole_copy: Optional[Callable[[str], None]] = None,
) -> torch.Tensor:
    """The paged-MQA logits of ``q`` (``[rows, 1, heads, dim]``), chunk by chunk, into one output.

    Chunks are SGLang's: rows ``[start, start + chunk_rows)``, each computed by
    ``logits_fn(q[s:e], kv_cache, weights[s:e], context_lens[s:e], block_table[s:e],
    schedule_fn(context_lens[s:e], block_kv, chunk_rows), max_len, clean_logits=False)``. Returns
    ``out`` (default: a new contiguous ``[rows, max_len]`` fp32 tensor, the shape and layout of
    ``torch.cat``'s) with the chunks' live columns (see the module docstring) copied in, bit for
    bit; its other columns are not written.

    Every argument is checked before the first chunk is computed (a bad one raises naming it). A
    chunk the kernel's one compiled variant does not take (not fp32, misaligned, a row stride that
    is not a multiple of 16) is copied whole instead, as ``torch.cat`` copies it, and
    ``on_whole_copy`` is called with the reason: the call still computes each chunk once.
    """
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(
            f"q must be [rows, 1, heads, dim] (one token per row), got {tuple(q.shape)}"
        )
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    rows = q.shape[0]
    if out is None:
        out = torch.empty((rows, max_len), dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != (rows, max_len):
        raise ValueError(
            f"out must be [rows, max_len] = [{rows}, {max_len}], got {tuple(out.shape)}"
        )
    mismatch = _layout_mismatch("out", out)
    if mismatch is not None:
        raise mismatch
    if context_lens.device != out.device:
        raise ValueError(f"context_lens is on {context_lens.device}, out on {out.device}")
    _check_destination(out, context_lens, 0, rows, budget)
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        chunk_lens = context_lens[start:end]
        chunk = logits_fn(
            q[start:end],
            kv_cache,
            weights[start:end],
            chunk_lens,
            block_table[start:end],
            schedule_fn(chunk_lens, block_kv, chunk_rows),
            max_len,
            clean_logits=False,
        )
        mismatch = _layout_mismatch("a chunk of logits", chunk, width=max_len, device=out.device)
        if mismatch is None:
            _launch_copy(chunk, out, context_lens, start, budget)
        else:
            out[start:end].copy_(chunk)
            if on_whole_copy is not None:
                on_whole_copy(str(mismatch))
        del chunk  # back to the allocator (or the graph pool) before the next chunk
    return out


def warm_up(device: torch.device) -> None:
    """Compile the copy kernel for ``device`` (its only variant), so no call compiles later."""
    device = torch.device(device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
    src = torch.zeros((2, ALIGN * 4), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    lengths = torch.full((2, 1), ALIGN * 4, dtype=torch.int32, device=device)
    copy_live_logits(src, dst, lengths, budget=2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        _warm_devices.add(device.index)


def is_warm(device: torch.device) -> bool:
    """Whether calls on ``device`` run without compiling: :func:`warm_up` ran for a CUDA device; on
    the CPU, Triton's interpreter never compiles."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    index = torch.cuda.current_device() if device.index is None else device.index
    return index in _warm_devices


def _row_stride(tensor: torch.Tensor) -> int:
    """The row stride to pass: a one-row tensor's is never used, and may be anything (PyTorch's
    DLPack export sets it to 1 on DeepGEMM's one-row outputs); pass an aligned constant instead, so
    that the launch keeps the one compiled variant."""
    return tensor.stride(0) if tensor.shape[0] > 1 else ALIGN


# ----------------------------------------------------------------------------------------------
# Argument checks (host-only: no device synchronization on the replay path)
# ----------------------------------------------------------------------------------------------


def _layout_mismatch(name, tensor, *, width=None, device=None) -> Optional[Exception]:
    """The error that ``tensor`` is not a 2-D fp32 layout of the kernel's one compiled variant
    (unit column stride, 16-byte aligned start, row stride a multiple of 16), or None."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32 or tensor.dim() != 2:
        return TypeError(
            f"{name} must be a 2-D float32 tensor, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    if width is not None and tensor.shape[1] != width:
        return ValueError(f"{name} must be {width} columns wide, got {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        return ValueError(f"{name} is on {tensor.device}, expected {device}")
    if tensor.shape[0] and tensor.shape[1] and tensor.stride(1) != 1:
        return ValueError(f"{name} must have unit column stride, got strides {tensor.stride()}")
    if tensor.data_ptr() % 16:
        return ValueError(f"{name} must start 16-byte aligned (one compiled kernel variant)")
    if tensor.shape[0] > 1 and tensor.stride(0) % ALIGN:
        return ValueError(
            f"{name}'s row stride must be a multiple of {ALIGN}, got {tensor.stride(0)}"
        )
    return None


def _check_destination(dst, lengths, row_start, rows, budget) -> None:
    """The destination rows ``row_start .. + rows`` of ``dst`` (a checked layout), the lengths
    read for them and the budget."""
    width = dst.shape[1]
    if width % ALIGN:
        raise ValueError(f"the width must be a multiple of {ALIGN}, got {width}")
    if not isinstance(row_start, int) or row_start < 0 or row_start + rows > dst.shape[0]:
        raise ValueError(
            f"row_start must be an int with row_start + rows <= dst rows ({dst.shape[0]}), "
            f"got row_start={row_start!r} for {rows} rows"
        )
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.device != dst.device:
        raise ValueError(f"lengths is on {lengths.device}, expected {dst.device}")
    if lengths.dtype != torch.int32:
        raise TypeError(f"lengths must be int32, got {lengths.dtype}")
    if lengths.dim() not in (1, 2) or (lengths.dim() == 2 and lengths.shape[1] != 1):
        raise ValueError(f"lengths must be [n] or [n, 1], got {tuple(lengths.shape)}")
    if lengths.shape[0] < row_start + rows:
        raise ValueError(
            f"lengths needs at least row_start + rows = {row_start + rows} entries, "
            f"got {lengths.shape[0]}"
        )
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be None or an int >= 1, got {budget!r}")
