"""Replay-metadata scenarios shared by the tests and the benchmarks.

A :class:`MetadataCase` holds the inputs of one replay-metadata call (decode, target verify or draft
extend) in SGLang 0.5.23's keyword form, makes poisoned output buffers for it, and runs any arm on
them: SGLang's unbounded kernel, SGLang's KPool kernel at ``index_kpool=1``, or ours. Comparing two
arms compares every element of every output buffer, including what both must leave untouched.

For the MTP draft decode, a decode case's buffers are made once per draft step backend:
:func:`run_draft_decode_multi` writes them all in our one launch, :func:`run_stock_draft_decode` the way
SGLang 0.5.23 does (its decode kernel into a ``torch.empty`` scratch, then full-width copies).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
from collections.abc import Callable
from typing import Optional

import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from support.constants import POISON, SMALL_WIDTH, WIDTH_1M
from support.reference import kpool_module, metadata_module

SPARE = 2  # rows / entries past the live batch in every output buffer, which must stay untouched
OPS = ("decode", "verify", "draft_extend")
ARMS = ("sglang", "sglang_kpool", "bounded")

_SGLANG_NAMES = {
    "decode": ("fused_dsa_decode_metadata", "decode", "fused_dsa_decode_metadata_kpool"),
    "verify": (
        "fused_dsa_target_verify_metadata",
        "verify",
        "fused_dsa_target_verify_metadata_kpool",
    ),
    "draft_extend": (
        "fused_dsa_draft_extend_metadata",
        "draft_extend",
        "fused_dsa_draft_extend_metadata_kpool",
    ),
}
_BOUNDED = {
    "decode": bounded.fused_dsa_decode_metadata_bounded,
    "verify": bounded.fused_dsa_target_verify_metadata_bounded,
    "draft_extend": bounded.fused_dsa_draft_extend_metadata_bounded,
}


def kernel_for(op: str, arm: str):
    """The wrapper of ``arm`` for ``op``; SGLang's asserts are stripped for CPU tensors (interpreter)."""
    if arm == "bounded":
        return _BOUNDED[op]
    strip = not torch.cuda.is_available()
    name, kpool_file, kpool_name = _SGLANG_NAMES[op]
    if arm == "sglang":
        return getattr(metadata_module(strip_asserts=strip), name)
    if arm == "sglang_kpool":
        return getattr(kpool_module(kpool_file, strip_asserts=strip), kpool_name)
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


@dataclasses.dataclass
class MetadataCase:
    """One replay-metadata call: inputs as the DSA backend passes them."""

    op: str
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    width: int
    page_size: int = 64
    topk: int = 2048
    next_n: int = 1
    with_page_table_1: bool = True
    with_ctx_lens_2d: bool = False
    extend_seq_lens: Optional[torch.Tensor] = None
    static_extend_len: bool = True
    total_len: int = 0
    max_extend_len: int = 1

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")

    @property
    def bs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def rows(self) -> int:
        """Page-table rows the kernels may write."""
        if self.op == "decode":
            return self.bs
        if self.op == "verify":
            return self.bs * self.next_n
        return self.bs * self.max_extend_len

    def outputs(self) -> dict[str, Optional[torch.Tensor]]:
        """Output buffers filled with :data:`POISON`, with :data:`SPARE` rows and entries past
        what the call may write (as a CUDA graph's buffers for a larger max bs have)."""
        device = self.req_to_token.device
        rows = self.rows + SPARE
        bs_cap = self.bs + SPARE

        def poisoned(*shape):
            return torch.full(shape, POISON, dtype=torch.int32, device=device)

        out = {
            "cache_seqlens": poisoned(bs_cap),
            "cu_seqlens_k": poisoned(bs_cap + 1),
            "page_table_1": poisoned(rows, self.width) if self.with_page_table_1 else None,
            "dsa_cache_seqlens": poisoned(rows),
            "dsa_cu_seqlens_k": poisoned(rows + 1),
            "real_page_table": (
                poisoned(rows, triton.cdiv(self.width, self.page_size))
                if self.page_size > 1
                else None
            ),
        }
        if self.op != "decode":
            out["seqlens_expanded"] = poisoned(rows)
        if self.with_ctx_lens_2d:
            out["paged_mqa_ctx_lens_2d"] = poisoned(self.bs, self.next_n)
        return out

    def kwargs(self, out: dict) -> dict:
        """SGLang 0.5.23's keyword arguments for this op, writing into ``out``."""
        kw = dict(
            seq_lens=self.seq_lens,
            req_pool_indices=self.req_pool_indices,
            req_to_token=self.req_to_token,
            bs=self.bs,
            dsa_index_topk=self.topk,
            physical_page_size=self.page_size,
            **out,
        )
        if self.op == "decode":
            kw["max_len"] = self.width
        else:
            kw["max_seqlen_k"] = self.width
        if self.op == "verify":
            kw["next_n"] = self.next_n
        if self.op == "draft_extend":
            kw.update(
                extend_seq_lens=self.extend_seq_lens,
                total_len=self.total_len,
                max_extend_len=self.max_extend_len,
                max_total_len=self.bs * self.max_extend_len,
                static_extend_len=self.static_extend_len,
            )
        return kw

    def call(self, arm: str, out: dict, budget: Optional[int] = None) -> Callable[[], None]:
        """``arm``'s kernel wrapper bound to this case's arguments and ``out``, ready to call."""
        kw = self.kwargs(out)
        if arm == "bounded":
            kw["budget"] = budget
        elif arm == "sglang_kpool":
            kw["index_kpool"] = 1
        return functools.partial(kernel_for(self.op, arm), **kw)

    def run(self, arm: str, out: dict, budget: Optional[int] = None) -> dict:
        self.call(arm, out, budget)()
        return out


def make_case(
    op: str,
    lengths: list[int],
    *,
    width: int,
    device,
    pool_rows: int = 16,
    req_indices: Optional[list[int]] = None,
    extend_lens: Optional[list[int]] = None,
    next_n: int = 5,
    generator: Optional[torch.Generator] = None,
    req_to_token: Optional[torch.Tensor] = None,
    **options,
) -> MetadataCase:
    """A case with random ``req_to_token`` contents and request slots spread over the pool.

    ``next_n`` is the verify row count per request and, for draft extend, ``max_extend_len``;
    ``extend_lens`` gives per-request draft-extend lengths (default: static ``next_n``).
    """
    bs = len(lengths)
    if req_to_token is None:
        req_to_token = torch.randint(
            0, 1 << 30, (pool_rows, width), dtype=torch.int32, generator=generator
        ).to(device)
    pool_rows = req_to_token.shape[0]
    if req_indices is None:
        req_indices = torch.randperm(pool_rows, generator=generator)[:bs].tolist()
    case = MetadataCase(
        op=op,
        seq_lens=torch.tensor(lengths, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(req_indices, dtype=torch.int64, device=device),
        req_to_token=req_to_token,
        width=width,
        next_n=next_n,
        **options,
    )
    if op == "draft_extend":
        static = extend_lens is None
        ext = [next_n] * bs if static else extend_lens
        case.extend_seq_lens = torch.tensor(ext, dtype=torch.int32, device=device)
        case.static_extend_len = static
        case.total_len = sum(ext)
        case.max_extend_len = next_n
    return case


def compare(case: MetadataCase, arm: str, reference: str = "sglang", budget=None) -> list[str]:
    """Run ``arm`` and ``reference`` on identically poisoned buffers; names of buffers that differ."""
    expected = case.run(reference, case.outputs())
    actual = case.run(arm, case.outputs(), budget=budget)
    return [
        name
        for name, tensor in expected.items()
        if tensor is not None and not torch.equal(tensor, actual[name])
    ]


# ------------------------------------------------------------------------------------------------
# Lengths: edge cases first, then random ones
# ------------------------------------------------------------------------------------------------

SMALL_TOPK = 200  # below most small lengths, so that min(length, topk) is exercised
EDGE_LENGTHS = (0, 1, 127, 128, 129, SMALL_WIDTH - 1, SMALL_WIDTH)


def lengths_for(bs: int, generator: torch.Generator) -> list[int]:
    """Edge lengths (0, around 128, width - 1, width) in a random order, then random lengths,
    at :data:`SMALL_WIDTH`."""
    edges = [EDGE_LENGTHS[i] for i in torch.randperm(len(EDGE_LENGTHS), generator=generator)]
    random = torch.randint(0, SMALL_WIDTH + 1, (bs,), generator=generator).tolist()
    return (edges + random)[:bs]


def lengths_1m(bs: int, generator: torch.Generator) -> list[int]:
    """Edge lengths of a :data:`WIDTH_1M` table first, then random lengths.

    The first edges write long rows, so that the smallest batches do too: bs 1 is one full row; bs 4
    adds an empty row, a mid length off the 128-column grid (300_001 = 2343 blocks + 97) and a
    multiple of the 64-token page that is not one of 128 (524_352 = 4096.5 blocks).
    """
    edges = [WIDTH_1M, 0, 300_001, 524_352, WIDTH_1M - 1]
    edges += [1, 127, 128, 129, 1024, 65536, WIDTH_1M - 6, WIDTH_1M - 5]
    random = torch.randint(0, WIDTH_1M + 1, (bs,), generator=generator).tolist()
    return (edges + random)[:bs] if bs < len(edges) else edges + random[: bs - len(edges)]


# Programs that stride over several live tiles (CPU): three requests at width 1100, whose live ends
# are 1100, 640 and 256 columns: 9, 5 and 2 tiles of 128 columns; 1.07, 0.63 and 0.25 tiles of the
# default 1024, so that counting tiles with a floor division drops a partial last tile. With two
# programs per request, a program that handled only its first tile would leave tiles unwritten.
STRIDING_WIDTH = 1100
STRIDING_LENGTHS = [1100, 600, 129]

# Requests spanning three tiles or more of each tile size the CPU tests run (the tile_n fixture: 128
# and the default 1024 columns): live ends 3200, 2176 and 1152 columns, 25, 17 and 9 tiles of 128,
# and 3.1, 2.1 and 1.1 tiles of 1024. A tile placed anywhere but at its index in the request times
# TILE_N leaves columns of the request's third tile and later unwritten (of its second at most, the
# earlier tiles overlapping it, where the request spans two).
WIDE_WIDTH = 3200
WIDE_LENGTHS = [3200, 2100, 1100]


# ------------------------------------------------------------------------------------------------
# A req_to_token pool whose rows start past 2**31 elements, at no memory cost (CPU)
# ------------------------------------------------------------------------------------------------

# Linux's MAP_NORESERVE (Python 3.11's mmap does not name it): the mapping reserves no memory.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_LEAD_ROWS = 4  # rows of the mapping before the pool's row 0


def req_to_token_past_int32(
    width: int, generator: torch.Generator
) -> tuple[torch.Tensor, list[int]]:
    """A CPU ``req_to_token`` pool (int32, contiguous rows of ``width``) whose last three slots start
    past 2**31 elements, and those slots (the last one first).

    The pool lies in an anonymous mapping that reserves no memory: only the pages of the rows written
    are backed (the mapping spans 16 GiB of address space). The last slots start a few rows short of
    2**32 elements, and the pool starts :data:`_LEAD_ROWS` rows into the mapping, so that a slot times
    the row stride wrapped to 32 bits (an int32 overflow) lands on mapped rows nothing wrote (zeros)
    just before the pool: a kernel that overflows reads wrong tokens instead of faulting. Slots 0 to
    3 and the last three hold random tokens.
    """
    rows = (2**32 - 1) // width + 1
    far = [rows - 1, rows - 2, rows - 3]
    if not all(2**31 < slot * width < 2**32 for slot in far):
        raise ValueError(f"width {width}: the last three slots must start between 2**31 and 2**32")
    numel = (_LEAD_ROWS + rows) * width
    mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    pool = torch.frombuffer(mapping, dtype=torch.int32, count=numel)[_LEAD_ROWS * width :]
    pool = pool.view(rows, width)
    written = [0, 1, 2, 3, *far]
    pool[written] = torch.randint(
        0, 1 << 30, (len(written), width), dtype=torch.int32, generator=generator
    )
    return pool, far


# ------------------------------------------------------------------------------------------------
# MTP draft decode: several step backends' decode metadata for one decode case
# ------------------------------------------------------------------------------------------------


def draft_decode_multi_kwargs(case: MetadataCase, outs: list[dict], budget=None) -> dict:
    """The keyword arguments of our one launch of ``case`` into every one of ``outs`` (decode
    :meth:`MetadataCase.outputs` dicts)."""
    return dict(
        seq_lens=case.seq_lens,
        req_pool_indices=case.req_pool_indices,
        req_to_token=case.req_to_token,
        destinations=[draft.DecodeMetadataDestination(**out) for out in outs],
        bs=case.bs,
        max_len=case.width,
        dsa_index_topk=case.topk,
        physical_page_size=case.page_size,
        budget=budget,
    )


def run_draft_decode_multi(case: MetadataCase, outs: list[dict], budget=None) -> list[dict]:
    """Our one launch into every one of ``outs`` (decode :meth:`MetadataCase.outputs` dicts)."""
    draft.fused_dsa_draft_decode_metadata_multi(**draft_decode_multi_kwargs(case, outs, budget))
    return outs


def stock_scratch(case: MetadataCase) -> dict[str, Optional[torch.Tensor]]:
    """The buffers SGLang 0.5.23 allocates with ``torch.empty`` on every MTP draft-decode replay
    (``dsa_backend_mtp_precompute._precompute_decode_mode``, kpool 1): a full-width page table, the
    compact table when the page size is above 1, and the length vectors."""
    device, bs, width = case.req_to_token.device, case.bs, case.width

    def empty(*shape):
        return torch.empty(shape, dtype=torch.int32, device=device)

    return {
        "cache_seqlens": empty(bs),
        "cu_seqlens_k": empty(bs + 1),
        "page_table_1": empty(bs, width),
        "dsa_cache_seqlens": empty(bs),
        "dsa_cu_seqlens_k": empty(bs + 1),
        "real_page_table": (
            empty(bs, triton.cdiv(width, case.page_size)) if case.page_size > 1 else None
        ),
    }


def stock_copy_pairs(scratch: dict, out: dict, bs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of every copy SGLang 0.5.23 makes from the scratch into one step
    backend (``fused_metadata_copy_multi_cuda`` / ``_copy_base_replay_buffers``, decode): the length
    vectors without the cumsum heads (zero since capture), the page tables full width."""
    if out["page_table_1"] is None:
        raise ValueError("the stock path copies page_table_1, which every draft step backend has")
    pairs = [
        (out["cache_seqlens"][:bs], scratch["cache_seqlens"]),
        (out["cu_seqlens_k"][1 : bs + 1], scratch["cu_seqlens_k"][1:]),
        (out["page_table_1"][:bs, : scratch["page_table_1"].shape[1]], scratch["page_table_1"]),
        (out["dsa_cache_seqlens"][:bs], scratch["dsa_cache_seqlens"]),
        (out["dsa_cu_seqlens_k"][1 : bs + 1], scratch["dsa_cu_seqlens_k"][1:]),
    ]
    real = scratch["real_page_table"]
    if real is not None:
        pairs.append((out["real_page_table"][:bs, : real.shape[1]], real))
    return pairs


def run_stock_draft_decode(
    case: MetadataCase, outs: list[dict], *, foreach: bool = False
) -> list[dict]:
    """SGLang 0.5.23's MTP draft-decode replay metadata (kpool 1): its decode kernel into a fresh
    :func:`stock_scratch`, then every :func:`stock_copy_pairs` copy into each of ``outs``, one
    ``copy_`` per buffer, or all in one ``torch._foreach_copy_`` with ``foreach``."""
    scratch = stock_scratch(case)
    kwargs = case.kwargs(scratch)
    if kwargs["real_page_table"] is None:  # page size 1: SGLang passes the wide table
        kwargs["real_page_table"] = scratch["page_table_1"]
    kernel_for("decode", "sglang")(**kwargs)
    pairs = [pair for out in outs for pair in stock_copy_pairs(scratch, out, case.bs)]
    if foreach:
        torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
    else:
        for dst, src in pairs:
            dst.copy_(src)
    return outs


# ------------------------------------------------------------------------------------------------
# SGLang's replay calls at captured batch sizes (for the compile-count test)
# ------------------------------------------------------------------------------------------------


class CapturedBuffers:
    """The graph buffers of one DSA backend (kpool 1, speculative decoding) as SGLang 0.5.23 allocates
    them, on ``req_to_token``'s device: ``init_cuda_graph_state`` makes one ``[max_rows, width]``
    page table, and ``_build_forward_metadata_cuda_graph`` gives each captured bs a row slice of it
    and fresh length vectors, compact table and expanded lengths. The graph runner's input buffers
    (``seq_lens``, ``req_pool_indices``: int64, ``max_bs``) are sliced to ``bs`` at each replay."""

    def __init__(self, req_to_token, *, max_bs: int, next_n: int, page_size: int, topk: int):
        self.req_to_token, self.next_n = req_to_token, next_n
        self.page_size, self.topk = page_size, topk
        self.device, self.width = req_to_token.device, req_to_token.shape[1]
        self.page_table = torch.zeros(
            max_bs * next_n, self.width, dtype=torch.int32, device=self.device
        )
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._per_bs: dict[tuple[str, int], dict] = {}

    def _int32(self, *shape):
        return torch.zeros(shape, dtype=torch.int32, device=self.device)

    def replay_kwargs(self, op: str, bs: int) -> dict:
        """The keyword arguments of SGLang's replay call of ``op`` at ``bs``, on this backend's
        captured buffers (the same objects at every call)."""
        if (op, bs) not in self._per_bs:
            rows = bs if op == "decode" else bs * self.next_n
            buffers = dict(
                cache_seqlens=self._int32(bs),
                cu_seqlens_k=self._int32(bs + 1),
                page_table_1=self.page_table[:rows],
                dsa_cache_seqlens=self._int32(rows),
                dsa_cu_seqlens_k=self._int32(rows + 1),
                real_page_table=(
                    self._int32(rows, triton.cdiv(self.width, self.page_size))
                    if self.page_size > 1
                    else self.page_table[:rows]
                ),
            )
            if op != "decode":
                buffers["seqlens_expanded"] = self._int32(rows)
            self._per_bs[op, bs] = buffers
        kwargs = dict(
            seq_lens=self.seq_lens[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            req_to_token=self.req_to_token,
            **self._per_bs[op, bs],
            bs=bs,
            dsa_index_topk=self.topk,
            physical_page_size=self.page_size,
        )
        if op == "decode":
            kwargs["max_len"] = self.width
        else:
            kwargs["max_seqlen_k"] = self.width
        if op == "verify":
            kwargs.update(next_n=self.next_n, paged_mqa_ctx_lens_2d=None)
        if op == "draft_extend":
            kwargs.update(
                extend_seq_lens=torch.full(
                    (bs,), self.next_n, dtype=torch.int32, device=self.device
                ),
                total_len=bs * self.next_n,
                max_extend_len=self.next_n,
                max_total_len=bs * self.next_n,
                static_extend_len=True,
            )
        return kwargs


def one_launch_kwargs(steps: list[CapturedBuffers], bs: int, seq_lens, req_pool_indices) -> dict:
    """The one launch's keyword arguments into MTP draft step backends' decode buffers at ``bs``."""
    first = steps[0].replay_kwargs("decode", bs)
    names = draft.DecodeMetadataDestination._fields
    return dict(
        seq_lens=seq_lens,
        req_pool_indices=req_pool_indices,
        req_to_token=first["req_to_token"],
        destinations=[
            draft.DecodeMetadataDestination(
                **{name: step.replay_kwargs("decode", bs)[name] for name in names}
            )
            for step in steps
        ],
        bs=bs,
        max_len=first["max_len"],
        dsa_index_topk=first["dsa_index_topk"],
        physical_page_size=first["physical_page_size"],
    )
