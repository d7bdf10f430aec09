"""Replay-metadata scenarios shared by the tests, the benchmark and ``python -m sglang_dsa_mtp``.

A :class:`MetadataCase` holds the inputs of one replay-metadata call (decode, target verify or draft
extend) in SGLang 0.5.23's keyword form, makes poisoned output buffers for it, and runs any arm on
them: SGLang's unbounded kernel, SGLang's KPool kernel at ``index_kpool=1``, or ours. Comparing two
arms compares every element of every output buffer, including what both must leave untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.reference import kpool_module, metadata_module

POISON = -0x2B2B2B2B  # sentinel every output buffer starts with
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

    def run(self, arm: str, out: dict, budget: Optional[int] = None) -> dict:
        kw = self.kwargs(out)
        if arm == "bounded":
            kw["budget"] = budget
        elif arm == "sglang_kpool":
            kw["index_kpool"] = 1
        kernel_for(self.op, arm)(**kw)
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
