"""Seeded random replay-metadata cases for the differential tests (our kernels against SGLang's).

:func:`random_case` draws one call of an op in one form (``FORMS``): decode, target verify, draft
extend with static, per-request (ragged, zeros included) or all-zero extend lengths, or with padded
CUDA-graph rows (seq_len 1 in slot 0, as SGLang's graph runner pads a smaller batch). A case draws
its width (128 columns to the 1M-token table; the pool's rows at full width or cut to the width,
a row stride past the width), page size (1 or 64), whether ``page_table_1`` is written (page 64
only), batch size, verify rows or draft-extend length (1 to 6), request slots and lengths, about
half of them at the edges of the width, of a page, of a 128-column block and of a 1024-column tile. :func:`budgets` gives the
budgets every case runs at: 1, rows - 1, rows, 3 x rows + 1, the default and above it, where rows
are the page-table rows the call writes.

The draws depend only on the seed, so a failing case is reproduced by its test id.
"""

from __future__ import annotations

import torch

from sglang_dsa_mtp.kernels.ops.host import default_budget
from support.constants import WIDTH_1M
from support.metadata_cases import MetadataCase, make_case

FORMS = ("decode", "verify", "draft_extend_static", "draft_extend_ragged", "draft_extend_zero")
FORMS_PADDED = ("decode", "verify", "draft_extend_static", "draft_extend_ragged")
# Widths: one block, just past it, odd, one tile and two, a page multiple that is not a block one,
# a 64k table, and SGLang's default 1M-token table (a third of the cases).
WIDTHS = (128, 129, 1000, 1024, 2048, 4160, 65_600) + (WIDTH_1M,) * 4
BATCH_SIZES = (1, 2, 3, 4, 7, 8, 13, 16, 18, 19, 24, 28, 30, 32, 48)
POOL_ROWS = 64  # request slots of the shared req_to_token pool


def edge_lengths(width: int) -> list[int]:
    """Lengths at the edges of the width, a page (64), a block (128) and a tile (1024)."""
    edges = {0, 1, width - 1, width}
    for step in (64, 128, 1024):
        for multiple in (step, 2 * step, (width // step) * step):
            edges.update({multiple - 1, multiple, multiple + 1})
    return sorted(n for n in edges if 0 <= n <= width)


def _lengths(bs: int, width: int, gen: torch.Generator) -> list[int]:
    edges = edge_lengths(width)
    lengths = []
    for _ in range(bs):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if kind <= 1:
            lengths.append(edges[int(torch.randint(0, len(edges), (1,), generator=gen))])
        elif kind == 2:
            lengths.append(int(torch.randint(0, min(width, 4096) + 1, (1,), generator=gen)))
        else:
            lengths.append(int(torch.randint(0, width + 1, (1,), generator=gen)))
    return lengths


def _pick(options, gen: torch.Generator):
    return options[int(torch.randint(0, len(options), (1,), generator=gen))]


def random_case(
    form: str, seed: int, req_to_token: torch.Tensor, *, padded: bool = False
) -> MetadataCase:
    """One seeded call of ``form`` on ``req_to_token`` (``[POOL_ROWS, >= width]``). ``padded``: the
    last 1 to 3 requests are CUDA-graph padding (seq_len 1, slot 0; static extend length)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    gen = torch.Generator().manual_seed(seed)
    width = min(_pick(WIDTHS, gen), req_to_token.shape[1])
    if bool(
        torch.randint(0, 2, (1,), generator=gen)
    ):  # the pool cut to the width: row stride > width
        req_to_token = req_to_token[:, :width]
    page_size = _pick((1, 64), gen)
    with_pt1 = page_size == 1 or bool(torch.randint(0, 2, (1,), generator=gen))
    bs = _pick(BATCH_SIZES, gen)
    if padded:
        bs = max(bs, 2)
    live = bs - (min(int(torch.randint(1, 4, (1,), generator=gen)), bs - 1) if padded else 0)
    op = "decode" if form == "decode" else ("verify" if form == "verify" else "draft_extend")
    next_n = int(torch.randint(1, 7, (1,), generator=gen))  # verify rows, or max extend length
    lengths = _lengths(live, width, gen)
    if op == "verify":  # its live KV length is seq_lens + next_n
        lengths = [max(0, n - next_n) for n in lengths]
    slots = torch.randperm(POOL_ROWS, generator=gen)[:live].tolist()
    lengths += [1] * (bs - live)
    slots += [0] * (bs - live)
    extend_lens = None
    if form == "draft_extend_ragged":
        extend_lens = torch.randint(0, next_n + 1, (live,), generator=gen).tolist()
        extend_lens += [next_n] * (bs - live)
    elif form == "draft_extend_zero":
        extend_lens = [0] * bs
    return make_case(
        op,
        lengths,
        width=width,
        device=req_to_token.device,
        req_indices=slots,
        extend_lens=extend_lens,
        next_n=next_n,
        page_size=page_size,
        with_page_table_1=with_pt1,
        with_ctx_lens_2d=op == "verify" and bool(torch.randint(0, 2, (1,), generator=gen)),
        req_to_token=req_to_token,
        generator=gen,
    )


def written_rows(case: MetadataCase) -> int:
    """The page-table rows the call writes: bs, bs x next_n, or the extend rows."""
    if case.op == "decode":
        return case.bs
    if case.op == "verify":
        return case.bs * case.next_n
    return case.total_len


def budgets(case: MetadataCase) -> list[int | None]:
    """1, rows - 1, rows, 3 x rows + 1, the default (None) and twice the default plus 1."""
    rows = max(1, written_rows(case))
    default = default_budget(case.req_to_token.device)
    return sorted({1, max(1, rows - 1), rows, 3 * rows + 1, 2 * default + 1}) + [None]
