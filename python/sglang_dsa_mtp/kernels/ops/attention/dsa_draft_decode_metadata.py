"""One bounded launch writes the decode replay metadata of up to 4 MTP draft step backends.

SGLang 0.5.23's ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph`` (kpool 1) runs
``fused_dsa_decode_metadata`` into a freshly allocated full-width scratch table (bs x context width,
plus the compact ``real_page_table``), then copies every scratch buffer, full width, into each draft
step backend's CUDA-graph buffers. :func:`fused_dsa_draft_decode_metadata_multi` replaces both: one
launch of the bounded decode kernel (``dsa_metadata_bounded.bounded_decode_metadata_kernel``, with
every destination's buffers as its tuples of outputs; its grid never depends on the live lengths)
reads each live ``req_to_token`` tile once and stores it into every destination.

Each destination receives exactly what ``fused_dsa_decode_metadata_bounded`` (and so SGLang's
``fused_dsa_decode_metadata``) writes into it: ``cache_seqlens[:bs]``, ``cu_seqlens_k[:bs + 1]``,
``dsa_cache_seqlens[:bs]`` (``min(seq, topk)``), ``dsa_cu_seqlens_k[:bs + 1]``, and per row ``r < bs``
the page-table columns ``c < min(width, 128 * cdiv(seq_lens[r], 128))`` of ``page_table_1`` and the
page-start entries of that region in ``real_page_table``. Everything else keeps its old contents.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch

from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded import (
    LENGTH_VECTORS,
    bounded_decode_metadata_kernel,
    decode_launch,
)
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_common import (
    check_common,
    page_tables,
    zero_cumsum_heads,
)
from sglang_dsa_mtp.kernels.ops.launch import Binder, Launch

MAX_DESTINATIONS = 4  # draft step backends one launch serves (EAGLE speculative_num_steps <= 5)


class DecodeMetadataDestination(NamedTuple):
    """One draft step backend's decode CUDA-graph metadata buffers for the captured bs.

    The fields and their meaning are those of ``fused_dsa_decode_metadata``'s outputs: ``page_table_1``
    may be None when ``physical_page_size > 1``; ``real_page_table`` is ignored (may be None) when
    ``physical_page_size == 1``, where the compact table is ``page_table_1`` itself.
    """

    cache_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    page_table_1: Optional[torch.Tensor]
    dsa_cache_seqlens: torch.Tensor
    dsa_cu_seqlens_k: torch.Tensor
    real_page_table: Optional[torch.Tensor]


def fused_dsa_draft_decode_metadata_multi(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    destinations: Sequence[DecodeMetadataDestination],
    bs: int,
    max_len: int,
    dsa_index_topk: int,
    physical_page_size: int,
    budget: Optional[int] = None,
) -> None:
    """Decode replay metadata into every one of ``destinations`` (1 to 4), in one bounded launch.

    Each destination ends up exactly as ``fused_dsa_decode_metadata_bounded`` (bit-identical to
    SGLang's ``fused_dsa_decode_metadata``) with the same arguments would leave it. The destinations
    must match each other: the same shapes, strides and dtypes, the same presence of
    ``page_table_1`` (and of ``real_page_table`` when ``physical_page_size > 1``), on the device of
    ``req_to_token``. ``budget``: the most page-table programs the launch may use (at least 1, as in
    :func:`~sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded.fused_dsa_decode_metadata_bounded`);
    None uses :func:`~sglang_dsa_mtp.kernels.ops.host.default_budget`.
    """
    launch = _one_launch(locals())
    if launch is not None:
        bounded_decode_metadata_kernel[launch.grid](**launch.arguments, **launch.options)


def _one_launch(a: Mapping[str, Any]) -> Optional[Launch]:
    bs, width = a["bs"], a["max_len"]
    destinations = _check_destinations(
        a["seq_lens"],
        a["req_pool_indices"],
        a["req_to_token"],
        a["destinations"],
        bs,
        width,
        a["physical_page_size"],
        a["budget"],
    )
    if bs == 0:
        zero_cumsum_heads(
            *(cu for d in destinations for cu in (d.cu_seqlens_k, d.dsa_cu_seqlens_k))
        )
        return None
    device = a["req_to_token"].device
    page_size = a["physical_page_size"]
    tables = [
        page_tables(d.page_table_1, d.real_page_table, bs, width, page_size, device)
        for d in destinations
    ]
    return decode_launch(a, width, [d._asdict() for d in destinations], tables)


ONE_LAUNCH_BINDER = Binder(
    "MTP one launch",
    bounded_decode_metadata_kernel,
    2,
    _one_launch,
    fused_dsa_draft_decode_metadata_multi,
)


# ----------------------------------------------------------------------------------------------
# Argument checks (host-only: no device synchronization on the replay path)
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _naming(prefix: str):
    """Prefix the argument errors raised inside with ``prefix.`` (the checks name the buffer)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{prefix}.{exc}") from None


def _check_destinations(
    seq_lens,
    req_pool_indices,
    req_to_token,
    destinations,
    bs,
    width,
    page_size,
    budget,
) -> tuple[DecodeMetadataDestination, ...]:
    if isinstance(destinations, DecodeMetadataDestination) or not isinstance(
        destinations, (list, tuple)
    ):
        raise TypeError(
            "destinations must be a list or tuple of DecodeMetadataDestination, one per draft "
            f"step backend, got {type(destinations).__name__}"
        )
    if not 1 <= len(destinations) <= MAX_DESTINATIONS:
        raise ValueError(
            f"destinations must hold 1 to {MAX_DESTINATIONS} DecodeMetadataDestination, "
            f"got {len(destinations)}"
        )
    for i, dest in enumerate(destinations):
        if not isinstance(dest, DecodeMetadataDestination):
            raise TypeError(
                f"destinations[{i}] must be a DecodeMetadataDestination, got {type(dest).__name__}"
            )
    check_common(seq_lens, req_pool_indices, req_to_token, bs, width, page_size, budget)
    for i, dest in enumerate(destinations):
        with _naming(f"destinations[{i}]"):
            check_common(
                seq_lens,
                req_pool_indices,
                req_to_token,
                bs,
                width,
                page_size,
                budget,
                cache_seqlens=(dest.cache_seqlens, bs),
                cu_seqlens_k=(dest.cu_seqlens_k, bs + 1),
                dsa_cache_seqlens=(dest.dsa_cache_seqlens, bs),
                dsa_cu_seqlens_k=(dest.dsa_cu_seqlens_k, bs + 1),
            )
            for name in LENGTH_VECTORS:
                tensor = getattr(dest, name)
                if tensor.stride(0) != 1:
                    raise ValueError(f"{name} must be contiguous, got stride {tensor.stride(0)}")
            page_tables(
                dest.page_table_1, dest.real_page_table, bs, width, page_size, req_to_token.device
            )
    # The kernel takes one set of strides (and one compile) for all destinations.
    first = destinations[0]
    fields = [f for f in DecodeMetadataDestination._fields if f != "real_page_table"]
    if page_size > 1:
        fields.append("real_page_table")
    for i, dest in enumerate(destinations[1:], start=1):
        for name in fields:
            expected, tensor = getattr(first, name), getattr(dest, name)
            if (expected is None) != (tensor is None):
                raise ValueError(
                    f"destinations[{i}].{name} is {_describe(tensor)} but destinations[0].{name} is "
                    f"{_describe(expected)}: all destinations must match"
                )
            if tensor is not None and _layout(tensor) != _layout(expected):
                raise ValueError(
                    f"destinations[{i}].{name} has {_describe(tensor)}, expected "
                    f"{_describe(expected)} as destinations[0].{name}: all destinations must match"
                )
    return tuple(destinations)


def _layout(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device


def _describe(tensor: Optional[torch.Tensor]) -> str:
    if tensor is None:
        return "None"
    return (
        f"shape {tuple(tensor.shape)}, stride {tensor.stride()}, {tensor.dtype} on {tensor.device}"
    )
